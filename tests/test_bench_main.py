"""python -m bench: dispatch to the programs, usage, unknown and missing programs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench import __main__ as entry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_usage_lists_every_program(capsys):
    assert entry.main([]) == 0
    out = capsys.readouterr().out
    for name in ("demo", "collectives", "compressed", "ckpt", "netsim"):
        assert name in out


def test_unknown_program(capsys):
    assert entry.main(["nonsense"]) == 2
    assert "unknown program 'nonsense'" in capsys.readouterr().err


def test_every_program_module_imports():
    import importlib

    for name, (module, _) in entry.PROGRAMS.items():
        assert callable(importlib.import_module(module).main), name


def test_dispatch_passes_arguments():
    proc = subprocess.run([sys.executable, "-m", "bench", "netsim", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--rate" in proc.stdout


# Records, when mpi4py.MPI is first imported (MPI starts), whether mpicomm's Open MPI default
# (libnbc's ring iallreduce: 1.8x faster for 16 MiB here) was in the environment by then.
_WATCH = """
import importlib.abc, os, sys
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "mpi4py.MPI":
            print("at MPI start:", os.environ.get("OMPI_MCA_coll_libnbc_iallreduce_algorithm"), flush=True)
            sys.meta_path.remove(self)
        return None
sys.meta_path.insert(0, Watch())
os.environ.pop("OMPI_MCA_coll_libnbc_iallreduce_algorithm", None)
from bench.__main__ import main
main([sys.argv[1], "--help"])
"""


@pytest.mark.once
def test_programs_start_mpi_only_after_mpicomm_set_its_defaults():
    for name in ("collectives", "train", "elastic"):
        proc = subprocess.run([sys.executable, "-c", _WATCH, name], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        starts = [line for line in proc.stdout.splitlines() if line.startswith("at MPI start:")]
        assert starts == ["at MPI start: 1"], (name, proc.stdout[-2000:], proc.stderr[-2000:])
