"""Counts beyond MPI's 32-bit range on MPI libraries without large-count calls."""
from __future__ import annotations

import mpi4py
from mpi4py import MPI

_INT_MAX = 2 ** 31 - 1


def native_large_counts() -> bool:
    """Whether MPI calls take counts and displacements beyond 2^31 - 1 (MPI-4 ``_c`` calls via mpi4py 4)."""
    return MPI.Get_version() >= (4, 0) and int(mpi4py.__version__.split(".")[0]) >= 4


#: The largest count or displacement one MPI call argument takes (tests patch it to force pieces).
MAX_COUNT = (1 << 62) if native_large_counts() else _INT_MAX
