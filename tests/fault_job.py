"""Fault-injection job (ULFM): one rank dies inside a call, the survivors must raise and go on.

    mpirun --with-ft ulfm -n 3 python -m mpi4py tests/fault_job.py CASE VICTIM DIR

(``hierarchical`` runs on 4 ranks with ``MPICOMM_NODE_SIZE=2``; ``stalled`` kills nobody.)

CASE names the call the survivors are in when VICTIM dies (``os._exit(9)``, between two calls
or inside one); DIR receives the victim's time of death. Each survivor checks that the call
raised ``mpicomm.RankFailedError`` naming VICTIM (a ``DistBackendError`` through the process
group), checks the agreements over the failed communicator, then shrinks, makes a new default
process group with ``reinit_process_group`` and checks a ``dist.all_reduce`` over the
survivors against the sum computed here. It prints one line
``OK CASE rank R detect S`` (S: seconds from the death to the error) and exits 0; anything else
raises (``-m mpi4py`` then aborts the job). A watchdog ends a stuck rank, naming where it was.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist

import mpicomm
from mpi4py import MPI  # (after mpicomm: it sets the ULFM defaults before MPI starts)
from mpicomm.distributed import reinit_process_group

WATCHDOG_S = 150.0
DETECT_S = 2.0


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

def arm(cls, name: str, out: pathlib.Path) -> None:
    """Make this process die on its next call of ``cls.name`` (inside a multi-step call)."""
    def dying(*args, **kwargs):
        die(out)
    setattr(cls, name, dying)


def plain(comm, victim, out):
    """Blocking all_reduce on the fast path; the victim dies between two calls."""
    t = torch.ones(4)
    comm.all_reduce(t)
    if comm.rank == victim:
        die(out)
    comm.all_reduce(t)


def half_async(comm, victim, out):
    """Async 16-bit all_reduce (reduce16, 16 bits on the wire): the survivors start it and wait;
    the victim dies instead of joining (had it joined, the call could complete before its
    death, as it did under load)."""
    x = torch.ones(1 << 12, dtype=torch.bfloat16)
    comm.all_reduce(torch.ones(4, dtype=torch.bfloat16))
    if comm.rank == victim:
        die(out)
    comm.all_reduce(x, async_op=True).wait()


def half_pipelined(comm, victim, out):
    """Async 16-bit all_reduce of 12 MiB, in reduce16's pipelined segments: every rank starts
    it, the victim dies with its first segments posted (run with segments at or below the TCP
    eager limit: docs/failures.md)."""
    x = torch.ones(3 << 21, dtype=torch.bfloat16)
    comm.all_reduce(torch.ones(4, dtype=torch.bfloat16))
    work = comm.all_reduce(x, async_op=True)
    if comm.rank == victim:
        die(out)
    work.wait()


def process_group(comm, victim, out):
    """dist.all_reduce through the mpicomm process group, async (the progress thread waits)."""
    t = torch.ones(16)
    dist.all_reduce(t)
    if comm.rank == victim:
        die(out)
    dist.all_reduce(t, async_op=True).wait()


def compressed(comm, victim, out):
    """1-bit compressed allreduce: the victim dies entering its second phase (the gather)."""
    from compressed import OnebitAllreduce

    ar = OnebitAllreduce(comm, hierarchical=False)
    x = torch.linspace(-1, 1, 4096)
    ar(x)
    if comm.rank == victim:
        arm(mpicomm.Communicator, "all_gather_into_tensor", out)
    ar(x)


def hierarchical(comm, victim, out):
    """Hierarchical 1-bit allreduce (MPICOMM_NODE_SIZE=2: 2 nodes of 2): the victim dies in its
    node phase; ranks of the other node wait in the cross-node phase."""
    from compressed import OnebitAllreduce

    ar = OnebitAllreduce(comm, hierarchical=True)
    x = torch.linspace(-1, 1, 4096)
    ar(x)
    if comm.rank == victim:
        arm(mpicomm.Communicator, "all_gather_into_tensor", out)
    ar(x)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 4))


def checkpoint(comm, victim, out):
    """ckpt.save: the victim dies writing the data (in its first MPI-IO round, as its O_DIRECT
    writes start where the file system takes them, or in its per-rank POSIX writes under ULFM)."""
    import ckpt
    import ckpt.direct_io
    import ckpt.io
    import ckpt.posix_io

    model = _model()
    ckpt.save(out / "before", model=model, step=0, comm=comm)
    if comm.rank == victim:
        ckpt.io._round = lambda *args: die(out)
        ckpt.direct_io.write = lambda *args, **kwargs: die(out)
        ckpt.posix_io.write = lambda *args, **kwargs: die(out)
    ckpt.save(out / "after", model=model, step=1, comm=comm)


def zero_step(comm, victim, out):
    """A ZeroOptimizer (stage 2) step: the victim dies in its gradient reduce-scatter."""
    from zero import ZeroOptimizer

    model = _model()
    opt = ZeroOptimizer(torch.optim.SGD, model.parameters(), stage=2, comm=comm, lr=0.1)
    for step in range(2):
        opt.zero_grad()
        model(torch.ones(2, 32)).sum().backward()
        if step == 1 and comm.rank == victim:
            arm(mpicomm.Communicator, "reduce_scatter_tensor", out)
            arm(mpicomm.Communicator, "all_reduce", out)
        opt.step()


def fsdp_async(comm, victim, out):
    """compressed.fsdp's collectives called async on the process group, as FSDP2's prefetch
    calls them: an int8 all-gather and 1-bit reduce-scatters; the survivors start the second
    reduce-scatter and wait, the victim dies instead of joining."""
    from compressed.fsdp import QuantizedAllGather, QuantizedReduceScatter

    pg, n = dist.group.WORLD, 64
    full, grads, shard = torch.empty(n * comm.size), torch.ones(n * comm.size), torch.empty(n)
    QuantizedAllGather()(full, torch.ones(n), pg, async_op=True).wait()
    rs = QuantizedReduceScatter(bits=1)
    rs(shard, grads, pg, dist.ReduceOp.AVG, async_op=True).wait()
    if comm.rank == victim:
        die(out)
    rs(shard, grads, pg, dist.ReduceOp.AVG, async_op=True).wait()


CASES = {f.__name__: f for f in (plain, half_async, half_pipelined, process_group, compressed,
                                   hierarchical, checkpoint, zero_step, fsdp_async)}


def stalled(comm, out) -> None:
    """No rank dies: rank 1 stalls past the process group's timeout. The ranks that waited get
    ProcessGroupTimeoutError (or RankFailedError, when a peer's timeout revoked first); rank 1's
    late call fails at once (the group's communicator is revoked); a new group works."""
    from mpicomm.distributed import ProcessGroupTimeoutError

    timeout = 2.0
    dist.destroy_process_group()
    mpicomm.distributed.init_process_group(timeout=datetime.timedelta(seconds=timeout))
    t = torch.ones(8)
    dist.all_reduce(t)
    if comm.rank == 1:
        time.sleep(timeout + 3)
    began = time.monotonic()
    try:
        dist.all_reduce(t)
    except ProcessGroupTimeoutError:
        took, how = time.monotonic() - began, "timeout"
        assert comm.rank != 1 and timeout - 0.1 <= took < timeout + 5, took
    except mpicomm.RankFailedError as exc:
        took, how = time.monotonic() - began, "revoked"
        # the stalled rank's late call fails at once; a waiting rank may see the revoke of a
        # peer that timed out first (after about the timeout)
        limit = DETECT_S if comm.rank == 1 else timeout + 5
        assert exc.failed_ranks == () and took < limit, (exc.failed_ranks, took)
    else:
        raise AssertionError(f"rank {comm.rank}: the stalled call did not fail")
    hows = comm.mpi_comm.allgather(how)
    assert hows[1] == "revoked" and "timeout" in hows, hows
    dist.destroy_process_group()
    mpicomm.distributed.init_process_group()
    t = torch.full((3,), float(comm.rank))
    dist.all_reduce(t)
    assert t.tolist() == [float(sum(range(comm.size)))] * 3, t
    dist.destroy_process_group()
    print(f"OK stalled rank {comm.rank} {how} {took:.3f}", flush=True)


def main() -> None:
    case, victim, out = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3])
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    comm = mpicomm.init()
    if not comm.fault_tolerant:
        raise SystemExit("fault_job.py: launch with `mpirun --with-ft ulfm` (Open MPI with ULFM)")
    mpicomm.distributed.init_process_group()
    if case == "stalled":
        return stalled(comm, out)
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
    # over the survivors, and (every_rank) false where a rank of the communicator failed
    assert comm.agree(True) and not comm.agree(True, every_rank=True)
    survivors = comm.shrink()
    expect_ranks = [r for r in range(comm.size) if r != victim]
    assert survivors.size == comm.size - 1, survivors
    node = survivors.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)    # (the shrink numbered it without one)
    assert survivors.local_size == node.Get_size(), (survivors.local_size, node.Get_size())
    node.Free()
    assert survivors.rank == expect_ranks.index(comm.rank), (survivors.rank, comm.rank)
    assert survivors.agree(True) and not survivors.agree(comm.rank != expect_ranks[0])
    assert survivors.agree(True, every_rank=True)
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
