"""elastic.newcomer: a replacement's command line, split and run again as the interpreter would
(no MPI: the program runs in a subprocess started as a spawned replacement would be)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elastic import newcomer

pytestmark = pytest.mark.once    # no MPI: CI runs it on MPICH only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("argv,expected", [
    (["train.py", "--lr", "1"], ([], ["train.py", "--lr", "1"])),
    (["-m", "mpi4py", "train.py", "-x"], ([], ["-m", "mpi4py", "train.py", "-x"])),
    (["-u", "-X", "importtime", "-W", "ignore", "-m", "pkg.mod"], (["-u", "-X", "importtime", "-W", "ignore"],
                                                                  ["-m", "pkg.mod"])),
    (["-Wignore", "-B", "-c", "print(1)", "a"], (["-Wignore", "-B"], ["-c", "print(1)", "a"])),
    (["--check-hash-based-pycs", "never", "t.py"], (["--check-hash-based-pycs", "never"], ["t.py"])),
    (["-"], None),              # a program read from stdin cannot be read again
    (["-u"], None),             # the interactive interpreter
    (["-m"], None),
    (["-um", "mod"], None),     # a flag group ending in -m: spawned as it was started instead
])
def test_split_argv(argv, expected):
    assert newcomer.split_argv(argv) == expected


def _run(tmp_path, command):
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _as_replacement(tmp_path, program):
    """What ``program`` sees run through ``newcomer.run_program`` (as a replacement runs it) and
    run by the interpreter itself."""
    runner = ("import sys; sys.path.insert(0, sys.argv.pop(1)); from elastic import newcomer; "
              "newcomer.run_program(sys.argv[1:])")
    return _run(tmp_path, [sys.executable, "-c", runner, ROOT, *program]), _run(tmp_path, [sys.executable, *program])


SHOW = "import json, sys; print(json.dumps({'argv': sys.argv, 'path0': sys.path[0], 'name': __name__}))"


def test_a_script_runs_with_its_arguments_and_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text(SHOW)
    seen, direct = _as_replacement(tmp_path, ["sub/train.py", "--steps", "3"])
    assert seen == direct
    assert seen["argv"] == ["sub/train.py", "--steps", "3"]


def test_a_module_runs_as_main_from_the_working_folder(tmp_path):
    (tmp_path / "mymod.py").write_text(SHOW)
    seen, direct = _as_replacement(tmp_path, ["-m", "mymod", "a"])
    assert seen == direct
    assert seen["argv"][1:] == ["a"] and seen["name"] == "__main__"


def test_code_runs_with_its_arguments(tmp_path):
    seen, direct = _as_replacement(tmp_path, ["-c", SHOW, "x", "y"])
    assert seen == direct
    assert seen["argv"] == ["-c", "x", "y"]


def test_a_replacement_spawns_its_own_replacements_through_it_once(monkeypatch):
    """A replacement that grows the job later (it became rank 0) spawns the same command line it
    was started with: the program, through newcomer.py once (twice, the inner copy would merge
    again and fail)."""
    from elastic import grow

    path = os.path.abspath(newcomer.__file__)
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-X", "dev", "-m", "mpi4py", "train.py", "--lr", "1"])
    first = grow._command()
    assert first == (sys.executable, ["-X", "dev", path, "-m", "mpi4py", "train.py", "--lr", "1"])
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, *first[1]])
    assert grow._command() == first


def test_importing_elastic_leaves_ckpt_unloaded():
    # a replacement imports elastic on its way to joining: ckpt (0.3 s of imports) waits for first use
    code = "import sys, elastic, mpicomm, zero; print(sorted(m for m in sys.modules if m.split('.')[0] == 'ckpt'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
