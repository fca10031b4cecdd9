"""``monitored_barrier``: a barrier that names the ranks that did not arrive, with gloo's semantics.

Every rank but 0 sends an arrival message to rank 0 and waits for its release; rank 0 waits for
each rank in turn (within what is left of the timeout, or the whole timeout per rank with
``wait_all_ranks``), then releases them all. A rank that does not arrive in time is named in
rank 0's error, in gloo's words ("Rank 1 failed to pass monitoredBarrier in 100 ms"); the other
ranks then fail too, waiting for their release. The messages are empty and travel on the group's
communicator under the two highest tags MPI allows, which user messages are unlikely to use;
receives left waiting are cancelled. ``dist.monitored_barrier`` refuses every backend not named
gloo, so users call :func:`monitored_barrier` here (or the process group's method).
"""
from __future__ import annotations

import datetime
import time

import numpy as np
from mpi4py import MPI


def _seconds(timeout) -> float:
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise ValueError('monitored_barrier got unexpected value for argument "timeout" '
                         f"(expected: a timedelta or seconds >= 0, got: {timeout!r})")
    return float(seconds)


def _wait(request: MPI.Request, until: float) -> bool:
    """Test ``request`` until it completes (True) or ``until`` (monotonic) passes (False)."""
    while not request.Test():
        if time.monotonic() >= until:
            return False
        time.sleep(0)
    return True


def _cancel(requests) -> None:
    for request in requests:
        if request != MPI.REQUEST_NULL:
            request.Cancel()
            request.Wait()


def run(mpi_comm: MPI.Comm, timeout, wait_all_ranks: bool = False) -> None:
    """The monitored barrier over ``mpi_comm`` (every rank of it calls this)."""
    seconds = _seconds(timeout)
    ms = int(round(seconds * 1000))
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    if size == 1:
        return
    tag_ub = mpi_comm.Get_attr(MPI.TAG_UB)
    arrive, release = tag_ub, tag_ub - 1
    empty = [np.empty(0, np.uint8), MPI.BYTE]
    start = time.monotonic()
    if rank != 0:
        sent = mpi_comm.Isend(empty, 0, arrive)
        released = mpi_comm.Irecv([np.empty(0, np.uint8), MPI.BYTE], 0, release)
        if not (_wait(sent, start + seconds) and _wait(released, start + seconds)):
            _cancel([released])
            raise RuntimeError(
                f"Rank {rank} successfully reached monitoredBarrier, but received errors while "
                "waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank.")
        return
    arrivals = {peer: mpi_comm.Irecv([np.empty(0, np.uint8), MPI.BYTE], peer, arrive)
                for peer in range(1, size)}
    try:
        _wait_for(arrivals, start, seconds, ms, wait_all_ranks)
    finally:
        _cancel(r for r in arrivals.values() if not r.Test())
    releases = {peer: mpi_comm.Isend(empty, peer, release) for peer in range(1, size)}
    _wait_for(releases, time.monotonic(), seconds, ms, wait_all_ranks)


def _wait_for(requests: dict, start: float, seconds: float, ms: int, wait_all: bool) -> None:
    """Rank 0: wait for every peer's request in rank order, raising in gloo's words."""
    done, failed = [], []
    for peer, request in requests.items():
        if wait_all:  # each rank gets the whole timeout: a slow one must not hide the next
            until = time.monotonic() + seconds
        else:
            until = start + seconds
            if time.monotonic() >= until and not request.Test():
                arrived = f" (ranks that arrived: {done})" if done else ""
                raise RuntimeError(f"Rank 0 timed out in monitoredBarrier after {ms} ms{arrived}")
        if _wait(request, until):
            done.append(peer)
        elif wait_all:
            failed.append(peer)
        else:
            raise RuntimeError(f"[Rank 0]: Rank {peer} failed to pass monitoredBarrier in {ms} ms")
    if failed:
        ranks = ", ".join(map(str, failed))
        raise RuntimeError(f"[Rank 0]: Ranks {ranks} failed to pass monitoredBarrier in {ms} ms")


def monitored_barrier(group=None, timeout: datetime.timedelta | float | None = None,
                      wait_all_ranks: bool = False) -> None:
    """``dist.monitored_barrier`` for mpicomm groups (which torch's refuses by backend name):
    ``group`` (None: the default group), ``timeout`` (None: the group's), ``wait_all_ranks``.
    A gloo group is handed to torch's own; a rank outside ``group`` returns at once."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if group is None:
        group = c10d._get_default_group()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return
    backend = dist.get_backend(group)
    if backend == "mpicomm":  # the group is an MpicommProcessGroup
        group.monitored_barrier(timeout, wait_all_ranks)
        return
    if backend == dist.Backend.GLOO:
        dist.monitored_barrier(group, timeout, wait_all_ranks)
        return
    raise ValueError(f"mpicomm.distributed.monitored_barrier: expected a group of the mpicomm "
                     f"(or gloo) backend, got one of backend {backend!r}")
