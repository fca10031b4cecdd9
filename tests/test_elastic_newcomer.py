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


def test_a_spare_starts_through_it_with_its_priority_and_spawns_without_it(monkeypatch):
    """A spare's command line names the nice value of its imports before the program; a spare
    that later spawns (as the job's rank 0) spawns the program, with the priority asked for then."""
    from elastic import grow

    path = os.path.abspath(newcomer.__file__)
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "train.py", "--lr", "1"])
    spare = grow._command(10)
    assert spare == (sys.executable, [path, "--elastic-nice=10", "train.py", "--lr", "1"])
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, *spare[1]])
    assert grow._command() == (sys.executable, [path, "train.py", "--lr", "1"])
    assert grow._command(5) == (sys.executable, [path, "--elastic-nice=5", "train.py", "--lr", "1"])


@pytest.mark.parametrize("raw", ["-1", "20", "low"])
def test_a_bad_spare_nice_value_is_named(monkeypatch, raw):
    from elastic import grow

    monkeypatch.setenv(grow.SPARE_NICE_ENV, raw)
    with pytest.raises(ValueError, match=f"MPICOMM_ELASTIC_SPARE_NICE an int in \\[0, 19\\], got '{raw}'"):
        grow.spare_nice()


@pytest.mark.parametrize("raw", ["0", "-5", "soon"])
def test_a_bad_spawn_timeout_is_named(monkeypatch, raw):
    import elastic
    from elastic import newcomer

    monkeypatch.setenv(newcomer.SPAWN_TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=f"MPICOMM_ELASTIC_SPAWN_TIMEOUT_S a number of seconds > 0, got '{raw}'"):
        elastic.run(max_world_size=4)     # at the decoration, not at a spawn
    monkeypatch.setenv(newcomer.SPAWN_TIMEOUT_ENV, "2.5")
    assert newcomer.spawn_timeout() == 2.5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_warm_up_imports_in_a_thread_at_the_nice_value_and_leaves_the_caller_at_its_own(tmp_path):
    (tmp_path / "probe.py").write_text(
        "import os, threading\n"
        "me = threading.current_thread()\n"
        "nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())\n")
    code = ("import os, sys, threading; from elastic import newcomer; newcomer.WARM = ('probe',); "
            "before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()); newcomer.warm_up(19); "
            "import probe; print(probe.me is threading.main_thread(), probe.nice, before, "
            "os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    in_main, nice, before, after = out.stdout.split()
    assert in_main == "False" and int(nice) == 19 and after == before, out.stdout
