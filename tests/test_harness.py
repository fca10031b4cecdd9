"""The test harness itself: a failing rank must end the whole launch quickly, never hang it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mpiexec(n, *args, timeout=60):
    t0 = time.monotonic()
    proc = subprocess.run(["mpiexec", "-n", str(n), sys.executable, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def test_exception_on_one_rank_aborts_the_job(tmp_path):
    script = tmp_path / "fail_one.py"
    script.write_text(textwrap.dedent("""
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
        comm.Barrier()  # rank 0 would wait here forever without the abort
    """))
    proc, elapsed = _mpiexec(2, "-m", "mpi4py", str(script))
    assert proc.returncode != 0
    assert elapsed < 30, f"took {elapsed:.1f}s to end"
    assert "rank 1 fails on purpose" in proc.stderr


def test_failing_pytest_rank_aborts_the_pytest_job(tmp_path):
    test_file = tmp_path / "test_fail_one_rank.py"
    test_file.write_text(textwrap.dedent("""
        import pytest
        from mpi4py import MPI

        @pytest.mark.mpi(min_size=2)
        def test_one_rank_fails():
            assert MPI.COMM_WORLD.rank != 1, "rank 1 fails on purpose"

        @pytest.mark.mpi(min_size=2)
        def test_then_a_collective():
            MPI.COMM_WORLD.Barrier()
    """))
    proc, elapsed = _mpiexec(2, "-m", "mpi4py", "scripts/mpi_pytest.py", "--with-mpi", "-q",
                             "-p", "no:cacheprovider", "--rootdir", ROOT,
                             "-c", os.path.join(ROOT, "pyproject.toml"),
                             "--confcutdir", ROOT, "-o", f"testpaths={tmp_path}",
                             str(test_file), timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert elapsed < 60, f"took {elapsed:.1f}s to end"
    assert "rank 1 fails on purpose" in proc.stderr + proc.stdout


@pytest.mark.mpi(min_size=1)
def test_shared_tmp_path_is_the_same_on_every_rank(shared_tmp_path, world):
    from mpitest import assert_all

    paths = world.allgather(str(shared_tmp_path))
    assert_all(len(set(paths)) == 1 and shared_tmp_path.is_dir(), f"paths differ: {paths}")
