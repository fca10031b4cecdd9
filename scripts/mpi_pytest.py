"""Run pytest on one MPI rank; ranks other than 0 keep their terminal output in a log file.

Launched as ``mpiexec -n N python -m mpi4py scripts/mpi_pytest.py [pytest args]`` by
scripts/test.sh. Failures are still reported on stderr by the rank that failed (the abort
hook in tests/conftest.py), and a rank's log is replayed to stderr if its run failed.
"""
import os
import sys
import tempfile

import pytest
from mpi4py import MPI


def main() -> int:
    rank = MPI.COMM_WORLD.Get_rank()
    log_path = None
    if rank != 0:
        fd, log_path = tempfile.mkstemp(prefix=f"mpicomm-pytest-rank{rank}-", suffix=".log")
        sys.stdout.flush()
        os.dup2(fd, 1)
        os.close(fd)
    rc = pytest.main(sys.argv[1:])
    if log_path is not None:
        sys.stdout.flush()
        if rc not in (0, 5):
            with open(log_path, errors="replace") as f:
                sys.stderr.write(f"--- rank {rank} pytest output ---\n{f.read()}")
        os.unlink(log_path)
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
