"""mpicomm: MPI collectives over torch tensors, numpy and cupy arrays."""
from __future__ import annotations

from .communicator import Communicator, init, get_world, is_initialized

__all__ = ["Communicator", "init", "get_world", "is_initialized"]
