"""``reinit_process_group``: torch.distributed's default group again, on the survivors of a failure."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..communicator import Communicator, as_communicator
from . import _registration
from ._mesh_caches import clear_mesh_caches
from ._pg import BACKEND_NAME, DEFAULT_TIMEOUT, MpicommProcessGroup
from ._rendezvous import mpi_store


def _mpicomm_groups() -> list[MpicommProcessGroup]:
    """The mpicomm backends of every process group torch.distributed knows here."""
    found = []
    for pg in list(dist.distributed_c10d._world.pg_map):
        try:
            backend = pg._get_backend(torch.device("cpu"))
        except Exception:  # noqa: BLE001 - a group without a CPU backend is not ours
            continue
        if isinstance(backend, MpicommProcessGroup):
            found.append(backend)
    return found


def reinit_process_group(comm: Communicator, timeout: datetime.timedelta | None = None) -> None:
    """Replace torch.distributed's default process group with an mpicomm group on ``comm``
    (e.g. ``world.shrink()`` after a rank failed); collective over ``comm``.

    The old groups are dropped without any call to their ranks (the dead ones would never
    answer): they refuse further calls and their MPI communicators are not freed. The new
    group's TCPStore is hosted by ``comm``'s rank 0 (its address sent over MPI, so the store
    moves when the old host died); afterwards ``dist.get_rank()`` and ``dist.get_world_size()``
    are ``comm``'s, and DDP, DeviceMesh and new groups build on it; torch's DTensor caches keyed
    on meshes are cleared (a new mesh can equal an old one, see ``_mesh_caches``). ``timeout``: the new group's
    (default: the old default group's, else 30 minutes)."""
    comm = as_communicator(comm)
    groups = _mpicomm_groups() if dist.is_initialized() else []
    if timeout is None:
        default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        old = next((g for g in groups if default is not None
                    and g is _backend_of(default)), None)
        timeout = old.timeout if old is not None else DEFAULT_TIMEOUT
    for g in groups:
        g.abandon("after a rank failure (reinit_process_group made a new default group)")
    if dist.is_initialized():
        dist.destroy_process_group()  # local: no barrier, no store call
    clear_mesh_caches()
    store = mpi_store(timeout, comm.mpi_comm, from_env=False)
    _registration.register()
    _registration.set_world(comm)
    dist.init_process_group(BACKEND_NAME, store=store, rank=comm.rank, world_size=comm.size,
                            timeout=timeout)


def _backend_of(pg):
    try:
        return pg._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001
        return None
