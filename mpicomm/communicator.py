"""The Communicator: torch.distributed-style collectives on top of an mpi4py communicator."""
from __future__ import annotations

from mpi4py import MPI

_world: "Communicator | None" = None


class Communicator:
    """Collectives over torch tensors, numpy and cupy arrays on one MPI communicator."""

    def __init__(self, mpi_comm: MPI.Comm = MPI.COMM_WORLD) -> None:
        self.mpi_comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank = node.Get_rank()
        self.local_size = node.Get_size()
        node.Free()


def init() -> Communicator:
    """Return the world communicator, creating it on first use."""
    global _world
    if _world is None:
        _world = Communicator(MPI.COMM_WORLD)
    return _world


def get_world() -> Communicator:
    """Return the world communicator created by init()."""
    if _world is None:
        raise RuntimeError("mpicomm.init() has not been called")
    return _world


def is_initialized() -> bool:
    """Whether init() has created the world communicator."""
    return _world is not None
