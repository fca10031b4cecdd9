"""The torch.distributed backend "mpicomm": its registration and constructor, and the short init form."""
from __future__ import annotations

import datetime
import logging

import torch.distributed as dist
from mpi4py import MPI

from .. import progress_thread
from ..communicator import Communicator, init
from ._pg import BACKEND_NAME, MpicommProcessGroup
from ._rendezvous import install, launcher_hint, under_torchrun

_log = logging.getLogger("mpicomm")


#: The communicator torch.distributed's world spans: None for MPI.COMM_WORLD; after
#: ``reinit_process_group`` the survivors' communicator it was given.
_world: Communicator | None = None


def set_world(comm: Communicator | None) -> None:
    """Make ``comm`` (None: MPI.COMM_WORLD) the MPI side of torch.distributed's next world."""
    global _world
    _world = comm


def _create(backend_opts, pg_options=None) -> MpicommProcessGroup:
    """torch.distributed backend constructor (extended API): the MPI ranks of the new group."""
    world = MPI.COMM_WORLD if _world is None else _world.mpi_comm
    size, me = world.Get_size(), world.Get_rank()
    ranks = list(backend_opts.global_ranks_in_group) or list(range(size))
    default = not dist.is_initialized()
    torch_rank = backend_opts.group_rank if default else dist.get_rank()
    torch_size = backend_opts.group_size if default else dist.get_world_size()
    if torch_rank != me or torch_size != size:
        where = "" if _world is None else " of the communicator given to reinit_process_group"
        hint = f"; {launcher_hint(torch_size)}" if under_torchrun() else (
            "; call dist.init_process_group('mpicomm') without rank/world_size, or "
            "mpicomm.distributed.init_process_group()")
        raise RuntimeError(
            f"mpicomm process group: torch.distributed rank {torch_rank} of {torch_size} does "
            f"not match the MPI world (rank {me} of {size}{where}){hint}")
    if me not in ranks or ranks.index(me) != backend_opts.group_rank:
        raise RuntimeError(f"mpicomm process group: rank {me} expected at group rank "
                           f"{backend_opts.group_rank} of ranks {ranks}")
    base = init() if _world is None else _world
    if ranks == list(range(size)):
        mpi_comm = world.Dup()
    else:
        mpi_comm = world.Create_group(world.Get_group().Incl(ranks))
    pg = MpicommProcessGroup(Communicator(mpi_comm, check=base.check),
                             timeout=backend_opts.timeout, store=backend_opts.store)
    if backend_opts.group_rank == 0:
        _log.info("mpicomm process group %s: ranks %s, timeout %s, %s", backend_opts.group_id,
                  ranks if len(ranks) <= 16 else f"{ranks[:16]}... ({len(ranks)})",
                  backend_opts.timeout,
                  "non-blocking calls completed by the progress thread" if progress_thread.enabled()
                  else "MPI below THREAD_MULTIPLE: async calls complete before returning")
    return pg


def register() -> None:
    """Register the "mpicomm" backend and the MPI fallback of env:// (idempotent)."""
    install()
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                      devices=["cpu", "cuda"])


def init_process_group(timeout: datetime.timedelta | None = None, **kwargs) -> None:
    """``dist.init_process_group("mpicomm")``: rank and size from MPI, one TCPStore for all ranks."""
    register()
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(BACKEND_NAME, **kwargs)
