"""mpicomm: MPI collectives over torch tensors, numpy and cupy arrays, for PyTorch training.

What lives where: ``communicator`` (the Communicator and ``init``/``as_communicator``: one
launch path for blocking and async calls), ``reductions``, ``moves`` and ``p2p`` (its
reductions, its moves and its point-to-point calls), ``reduce16`` and ``kernels16`` (16-bit
reductions with 16 bits on the wire), ``world`` (the same calls as module functions),
``fastpath`` (the one rule that sends plain host tensors straight to MPI), ``validate`` and ``errors`` (argument checks and their messages), ``buffers``
(torch/numpy/cupy to MPI buffers and back), ``dtypes`` and ``ops`` (dtype and op tables),
``device_paths`` (direct or staged device buffers), ``large`` (counts beyond 2^31 on MPI-3
libraries), ``checking`` (checking mode), ``work``, ``requests`` and ``progress_thread``
(async handles, one handle over several MPI requests, and the thread that completes them),
``observe`` (profiler events and logging), ``faults`` and ``ft_env`` (rank failures as
``RankFailedError`` under ULFM; the launch default they need), ``byte_sizes`` (``format_bytes``), ``launch_env`` (``clean_env``: the environment for launching a fresh job),
and ``distributed/`` (the torch.distributed backend and DDP hook).
"""
from __future__ import annotations

import os as _os

# Open MPI's non-blocking allreduce (libnbc) picks, by default, an algorithm that ran 2-3x
# slower than its blocking one from 1 MiB up here; its ring algorithm runs as fast (2 and 4
# ranks, 1 and 16 MiB). Every process-group call is non-blocking, so mpicomm asks for the ring
# unless the user chose: it takes effect when mpicomm is imported before MPI starts.
_os.environ.setdefault("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1")

# Under `mpirun --with-ft ulfm` ranks on one node talk TCP unless the user chose the transports:
# over shared memory a rank that exits with a non-zero status is never reported failed, and the
# survivors hang (mpicomm.faults says what was measured).
from .ft_env import set_launch_defaults as _set_launch_defaults

_set_launch_defaults()

from . import distributed  # registers the "mpicomm" torch.distributed backend
from .communicator import Communicator, as_communicator, get_world, init, is_initialized
from .byte_sizes import format_bytes
from .errors import CollectiveMismatchError
from .faults import RankFailedError
from .launch_env import clean_env
from .ops import ReduceOp
from .work import WaitTimeoutError, Work
from .world import (all_gather, all_gather_into_tensor, all_reduce, all_to_all_single, barrier,
                    broadcast, gather, get_rank, get_world_size, irecv, isend, recv, reduce,
                    reduce_scatter_tensor, scatter, send, split)

__all__ = [
    "Communicator", "ReduceOp", "Work", "WaitTimeoutError", "CollectiveMismatchError",
    "RankFailedError",
    "init", "as_communicator", "get_world", "is_initialized", "get_rank", "get_world_size",
    "all_reduce", "reduce", "reduce_scatter_tensor", "broadcast", "all_gather_into_tensor",
    "all_gather", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
    "barrier", "split", "format_bytes", "clean_env",
]
