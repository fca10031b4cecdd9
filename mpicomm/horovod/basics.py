"""hvd.init() and the facts of the job: ranks, sizes, local and cross ranks, what is built."""
from __future__ import annotations

import atexit
from typing import Sequence

import torch
from mpi4py import MPI

import mpicomm

from .engine import Engine, wait_for


from ._state import _need, state


def init(comm: "mpicomm.Communicator | MPI.Comm | Sequence[int] | None" = None,
         process_sets=None) -> None:
    """Start Horovod on ``comm`` (an mpicomm Communicator, an mpi4py communicator, a list of
    world ranks, or None: the world), with optional static ``process_sets``. Idempotent."""
    from .process_sets import ProcessSet, _register, global_process_set

    if state.world is not None:
        return
    if comm is None:
        world = mpicomm.init().dup()          # in the family of mpicomm's world (ULFM revokes)
    elif isinstance(comm, mpicomm.Communicator):
        world = comm.dup()
    elif isinstance(comm, MPI.Comm):
        world = mpicomm.Communicator(comm.Dup())
    else:
        ranks = sorted(int(r) for r in comm)
        everyone = MPI.COMM_WORLD
        sub = everyone.Create_group(everyone.Get_group().Incl(ranks))
        if sub == MPI.COMM_NULL:
            raise ValueError(f"hvd.init(comm={list(comm)}): this rank ({everyone.Get_rank()}) "
                             "is not in the list; start Horovod only on the listed ranks")
        world = mpicomm.Communicator(sub)
    state.world = world
    state.cross = world.split(world.local_rank, key=world.rank)
    sizes = world.mpi_comm.allgather(world.local_size)
    state.homogeneous = len(set(sizes)) == 1
    global_process_set._attach(0, list(range(world.size)), world)
    state.sets = {0: global_process_set}
    state.next_set_id = 1
    if process_sets and process_sets != "dynamic":
        for ps in process_sets:
            if not isinstance(ps, ProcessSet):
                ps = ProcessSet(ps)
            _register(ps)


def shutdown() -> None:
    """Complete the calls in flight, then release every process set (hvd.init() may follow)."""
    if state.world is None:
        return
    for ps in list(state.sets.values()):
        if ps._engine is not None:
            try:
                ps._engine.drain()
            except Exception:  # noqa: BLE001 - a failed call stays with its handle
                pass
    for ps in list(state.sets.values()):
        ps._detach()
    if state.cross is not None:
        state.cross.free()
    state.world.free()
    state.world = state.cross = None
    state.sets = {}


def abandon() -> None:
    """Drop every process set without a collective (after a rank failure: elastic's reset)."""
    for ps in list(state.sets.values()):
        if ps._engine is not None:
            ps._engine.free(collective=False)
        ps._engine = ps._comm = None
        ps.process_set_id = None
    state.world = state.cross = None
    state.sets = {}


atexit.register(shutdown)


def is_initialized() -> bool:
    return state.world is not None


def engines() -> list[Engine]:
    return [ps._engine for ps in state.sets.values() if ps._engine is not None]


def wait(ops) -> None:
    wait_for(ops, engines)


def rank() -> int:
    return _need().rank


def size() -> int:
    return _need().size


def local_rank() -> int:
    return _need().local_rank


def local_size() -> int:
    return _need().local_size


def cross_rank() -> int:
    _need()
    return state.cross.rank


def cross_size() -> int:
    _need()
    return state.cross.size


def is_homogeneous() -> bool:
    _need()
    return state.homogeneous


def mpi_threads_supported() -> bool:
    _need()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    """0: collectives go through MPI (CUDA-aware MPI or staged through host memory), not NCCL."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.cuda.is_available()


def rocm_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    raise NotImplementedError("mpicomm.horovod has no timeline; use torch.profiler, where every "
                              "collective shows as an 'mpicomm:<op>' event (docs/horovod.md)")


def stop_timeline() -> None:
    raise NotImplementedError("mpicomm.horovod has no timeline (see start_timeline)")
