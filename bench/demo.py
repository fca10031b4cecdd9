"""The main job: a short showcase of mpicomm collectives."""
from __future__ import annotations

import numpy as np


def main(argv=None) -> int:
    import mpicomm

    comm = mpicomm.init()
    if comm.rank == 0:
        print(f"mpicomm demo on {comm.size} ranks")
    x = np.full(4, comm.rank + 1.0)
    comm.mpi_comm.Allreduce(np.copy(x), x)
    if comm.rank == 0:
        print("allreduce:", x)
    return 0
