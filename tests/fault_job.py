"""Fault-injection job (ULFM): one rank dies inside a call, the survivors must raise and go on.

    mpirun --with-ft ulfm -n 3 python -m mpi4py tests/fault_job.py CASE VICTIM DIR

CASE names the call the survivors are in when VICTIM dies (``os._exit(9)``, between two calls
or inside one); DIR receives the victim's time of death. Each survivor checks that the call
raised ``mpicomm.RankFailedError`` naming VICTIM (a ``DistBackendError`` through the process
group), then shrinks, makes a new default process group with ``reinit_process_group`` and checks
a ``dist.all_reduce`` over the survivors against the sum computed here. It prints one line
``OK CASE rank R detect S`` (S: seconds from the death to the error) and exits 0; anything else
raises (``-m mpi4py`` then aborts the job). A watchdog ends a stuck rank, naming where it was.
"""
from __future__ import annotations

import faulthandler
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist

import mpicomm
from mpicomm.distributed import reinit_process_group

WATCHDOG_S = 45.0


def die(out: pathlib.Path) -> None:
    """Record the time of death, then leave as a crashed process would (no cleanup)."""
    (out / "death").write_text(repr(time.time()))
    os._exit(9)


def death_time(out: pathlib.Path) -> float:
    """The victim's time of death (it wrote it before dying; same node, same clock)."""
    path = out / "death"
    until = time.monotonic() + 10
    while not path.exists() and time.monotonic() < until:
        time.sleep(0.01)
    return float(path.read_text())


# -- cases: each runs on every rank; the victim dies in it, the survivors return the error ---

def plain(comm, victim, out):
    """Blocking all_reduce on the fast path; the victim dies between two calls."""
    t = torch.ones(4)
    comm.all_reduce(t)
    if comm.rank == victim:
        die(out)
    comm.all_reduce(t)


def plain_async(comm, victim, out):
    """Async all_reduce (general path: a non-contiguous tensor), the victim dies before joining."""
    t = torch.ones(8, 2).t()
    comm.all_reduce(t)
    if comm.rank == victim:
        die(out)
    comm.all_reduce(t, async_op=True).wait()


def process_group(comm, victim, out):
    """dist.all_reduce (blocking, through the mpicomm process group)."""
    t = torch.ones(16)
    dist.all_reduce(t)
    if comm.rank == victim:
        die(out)
    dist.all_reduce(t)


CASES = {f.__name__: f for f in (plain, plain_async, process_group)}


def main() -> None:
    case, victim, out = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3])
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    comm = mpicomm.init()
    if not comm.fault_tolerant:
        raise SystemExit("fault_job.py: launch with `mpirun --with-ft ulfm` (Open MPI with ULFM)")
    mpicomm.distributed.init_process_group()
    try:
        CASES[case](comm, victim, out)
    except mpicomm.RankFailedError as exc:
        detect = time.time() - death_time(out)
        assert isinstance(exc, dist.DistBackendError), type(exc).__mro__
        assert exc.failed_ranks in ((victim,), ()), (exc.failed_ranks, str(exc))
        failed = exc.failed_ranks or comm.failed_ranks()
        assert failed == (victim,), (failed, str(exc))
    else:
        raise AssertionError(f"case {case}: rank {comm.rank} got no RankFailedError")
    survivors = comm.shrink()
    expect_ranks = [r for r in range(comm.size) if r != victim]
    assert survivors.size == comm.size - 1, survivors
    assert survivors.rank == expect_ranks.index(comm.rank), (survivors.rank, comm.rank)
    assert survivors.agree(True) and not survivors.agree(comm.rank != expect_ranks[0])
    reinit_process_group(survivors)
    assert (dist.get_rank(), dist.get_world_size()) == (survivors.rank, survivors.size)
    t = torch.full((5,), float(comm.rank + 1), dtype=torch.float64)
    dist.all_reduce(t)
    want = float(sum(r + 1 for r in expect_ranks))
    assert t.tolist() == [want] * 5, (t.tolist(), want)
    dist.destroy_process_group()
    print(f"OK {case} rank {comm.rank} detect {detect:.3f}", flush=True)


if __name__ == "__main__":
    main()
