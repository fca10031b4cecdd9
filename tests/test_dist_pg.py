"""The "mpicomm" backend on torch.distributed's main roads: plain init, one store, ops, async work."""
from __future__ import annotations

import datetime
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

import mpicomm  # noqa: F401 - registers the backend
import mpicomm.distributed as md
from mpitest import assert_all, assert_close_all, check_all

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.fixture
def plain():
    """The default group from a plain dist.init_process_group("mpicomm") (no rank, size, store)."""
    dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=60))
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_plain_init_takes_rank_and_size_from_mpi(plain, world):
    assert_all(dist.get_backend() == "mpicomm", dist.get_backend())
    assert_all(dist.get_rank() == world.rank and dist.get_world_size() == world.size,
               f"{dist.get_rank()}/{dist.get_world_size()}")
    assert_all(isinstance(plain, md.MpicommProcessGroup), type(plain).__name__)
    assert_all(plain.group_name != "", "the default group has a name")


def test_short_form_still_works(world):
    md.init_process_group(timeout=datetime.timedelta(seconds=30))
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        assert_close_all(t, np.full(3, float(world.size)))
    finally:
        dist.destroy_process_group()


def test_default_store_is_shared_by_all_ranks(plain, world):
    store = dist.distributed_c10d._get_default_store()
    r, n = world.rank, world.size
    store.set(f"from/{r}", f"rank {r}")
    for peer in range(n):
        store.wait([f"from/{peer}"])
        assert_all(store.get(f"from/{peer}") == f"rank {peer}".encode(), f"key from/{peer}")
    total = store.add("counter", r + 1)
    world.Barrier()
    assert_all(store.add("counter", 0) == n * (n + 1) // 2, f"counter after {total}")
    assert_all(store.timeout == datetime.timedelta(seconds=60), str(store.timeout))
    missing_ok = True
    try:
        store.wait(["never-set"], datetime.timedelta(milliseconds=200))
        missing_ok = False
    except (dist.DistStoreError, RuntimeError):
        pass
    assert_all(missing_ok, "wait on a key nobody set must time out")


def test_collectives_match_numpy(plain, world):
    r, n = world.rank, world.size
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t)
    assert_close_all(t, np.full(3, n * (n + 1) / 2))
    t = torch.full((2,), float(r + 1))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert_close_all(t, np.full(2, (n + 1) / 2), rtol=1e-6)
    out = torch.empty(2 * n)
    dist.all_gather_into_tensor(out, torch.full((2,), float(r)))
    assert_close_all(out, np.repeat(np.arange(n, dtype=float), 2))
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * n) + r)
    assert_close_all(rs, (np.arange(2.0 * n) * n + n * (n - 1) / 2)[2 * r:2 * r + 2])
    outs = [torch.empty(2) for _ in range(n)]
    dist.all_to_all(outs, [torch.full((2,), float(10 * r + j)) for j in range(n)])
    assert_close_all(torch.cat(outs), np.repeat(np.arange(n) * 10.0 + r, 2))
    g = [torch.empty(1) for _ in range(n)] if r == 0 else None
    dist.gather(torch.tensor([float(r)]), g, dst=0)
    if r == 0:
        assert_close_all(torch.cat(g), np.arange(n, dtype=float), comm=dist_comm_self())
    s = torch.empty(1)
    dist.scatter(s, [torch.tensor([float(7 * j)]) for j in range(n)] if r == n - 1 else None,
                 src=n - 1)
    assert_close_all(s, np.array([7.0 * r]))


def test_entry_points_of_older_torch(plain, world):
    """torch before 2.13 reaches the group by the former names (``dist.all_gather_into_tensor``
    calls ``_allgather_base``, ``reduce_scatter_tensor`` ``_reduce_scatter_base``, ...): the
    same results under every name."""
    r, n = world.rank, world.size
    calls = {
        "_allgather_base": lambda out: plain._allgather_base(out[0], torch.full((2,), float(r)),
                                                             c10d.AllgatherOptions()),
        "allgather_into_tensor_coalesced": lambda out: plain.allgather_into_tensor_coalesced(
            out, [torch.full((2,), float(r))], c10d.AllgatherOptions()),
    }
    for name, call in calls.items():
        out = [torch.empty(2 * n)]
        call(out).wait()
        assert_close_all(out[0], np.repeat(np.arange(n, dtype=float), 2), what=name)
    opts = c10d.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    for name in ("_reduce_scatter_base", "reduce_scatter_tensor_coalesced"):
        rs = torch.empty(2)
        x = torch.arange(2.0 * n) + r
        getattr(plain, name)(*((rs, x) if name.startswith("_") else ([rs], [x])), opts).wait()
        assert_close_all(rs, (np.arange(2.0 * n) * n + n * (n - 1) / 2)[2 * r:2 * r + 2], what=name)
    out = torch.empty(n)
    plain.alltoall_base(out, torch.arange(n, dtype=torch.float32) + 10 * r, [], [],
                        c10d.AllToAllOptions()).wait()
    assert_close_all(out, np.arange(n) * 10.0 + r)


def dist_comm_self():
    from mpi4py import MPI
    return MPI.COMM_SELF


def test_premul_sum_scales_then_sums(plain, world):
    n = world.size
    t = torch.full((4,), float(world.rank + 1))
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    assert_close_all(t, np.full(4, 0.5 * n * (n + 1) / 2), rtol=1e-6)
    out = torch.empty(2)
    inp = torch.arange(2.0 * n) + world.rank
    keep = inp.clone()
    dist.reduce_scatter_tensor(out, inp, op=dist._make_nccl_premul_sum(2.0))
    ref = 2.0 * (np.arange(2.0 * n) * n + n * (n - 1) / 2)
    assert_close_all(out, ref[2 * world.rank:2 * world.rank + 2], rtol=1e-6)
    assert_close_all(inp, keep.numpy(), what="PREMUL_SUM must not change the input")


@pytest.mark.parametrize("async_op", [False, True])
def test_premul_sum_of_bf16_rounds_once(plain, world, async_op):
    """bfloat16 PREMUL_SUM: the float32 sum times the factor, rounded once (numpy reference);
    a premultiply rounded to bfloat16 first would differ: 0.3 * x is not a bfloat16 value."""
    n, f = world.size, 0.3
    x = (torch.arange(40, dtype=torch.float32) * 1.37 + world.rank * 0.71).to(torch.bfloat16)
    rows = np.stack(world.allgather(x.float().numpy()))
    acc = rows[0].copy()
    for row in rows[1:]:
        acc = acc + row
    want = torch.from_numpy(acc * np.float32(f)).to(torch.bfloat16)
    t = x.clone()
    work = dist.all_reduce(t, op=dist._make_nccl_premul_sum(f), async_op=async_op)
    if async_op:
        work.wait()
    out = torch.empty(4, dtype=torch.bfloat16)
    inp = x[:4 * n].clone()
    dist.reduce_scatter_tensor(out, inp, op=dist._make_nccl_premul_sum(f))
    assert_all(torch.equal(t, want), f"all_reduce gave {t[:4].tolist()}, want {want[:4].tolist()}")
    assert_all(torch.equal(out, want[4 * world.rank:4 * world.rank + 4]),
               f"reduce_scatter gave {out.tolist()}")
    assert_all(torch.equal(inp, x[:4 * n]), "PREMUL_SUM must not change the input")


@pytest.mark.parametrize("name", ["BAND", "BOR", "BXOR"])
def test_bitwise_ops(plain, world, name):
    vals = [(0b1011 << r) | r for r in range(world.size)]
    t = torch.tensor([vals[world.rank], 0xFF ^ world.rank], dtype=torch.int32)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
    fn = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[name]
    ref = [fn.reduce(np.array(vals, dtype=np.int32)),
           fn.reduce(np.array([0xFF ^ r for r in range(world.size)], dtype=np.int32))]
    assert_close_all(t, np.array(ref, dtype=np.int32))
    flags = [[True, r % 2 == 0, False, r == 0] for r in range(world.size)]
    b = torch.tensor(flags[world.rank])
    dist.all_reduce(b, op=getattr(dist.ReduceOp, name))
    bool_fn = {"BAND": np.logical_and, "BOR": np.logical_or, "BXOR": np.logical_xor}[name]
    assert_close_all(b, bool_fn.reduce(np.array(flags), axis=0), what=f"{name} on bool")


def test_unsupported_op_error_names_it(plain):
    def check():
        with pytest.raises(ValueError, match=r"ReduceOp\.AVG") as info:
            dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG)
        assert "object at 0x" not in str(info.value)
    check_all(check)


def test_recv_from_any_source_reports_the_sender(plain, world):
    if world.size == 1:
        pytest.skip("needs 2 ranks")
    r, n = world.rank, world.size
    if r == 0:
        seen = set()
        for _ in range(n - 1):
            t = torch.empty(3)
            src = dist.recv(t)
            assert_close_all(t, np.full(3, float(src)), comm=dist_comm_self())
            seen.add(src)
        ok = seen == set(range(1, n))
    else:
        dist.send(torch.full((3,), float(r)), dst=0)
        ok = True
    assert_all(ok, "recv(src=None) must return every sender once")
    if r == 0:
        t = torch.empty(1)
        work = dist.irecv(t)
        work.wait()
        ok = work._source_rank() == n - 1 and t.item() == 5.0
    elif r == n - 1:
        dist.send(torch.tensor([5.0]), dst=0)
        ok = True
    assert_all(ok, "irecv(src=None)._source_rank()")


def test_async_work_is_pending_until_the_peer_joins(plain, world):
    """Launch returns before the last rank joins; the progress thread completes it unpolled."""
    if world.size == 1:
        pytest.skip("needs 2 ranks")
    store = dist.distributed_c10d._get_default_store()
    late = world.size - 1
    t = torch.full((1 << 22,), float(world.rank + 1))  # 16 MiB
    if world.rank == late:
        # every other rank has launched (and returned) before this rank joins
        store.wait([f"launched/{r}" for r in range(late)])
        work = dist.all_reduce(t, async_op=True)
        ok, pending_at_launch, fired = work.wait(), None, None
    else:
        done = threading.Event()
        work = dist.all_reduce(t, async_op=True)
        fut = work.get_future().then(lambda f: done.set())
        pending_at_launch = not work.is_completed()
        store.set(f"launched/{world.rank}", "1")
        fired = done.wait(60)  # no wait()/is_completed() in between: the progress thread did it
        ok = pending_at_launch and fired and fut.wait() is None and work.is_completed()
    assert_all(ok, f"pending at launch {pending_at_launch}, callback fired {fired}")
    assert_close_all(t[:4], np.full(4, world.size * (world.size + 1) / 2))


def test_ddp_with_async_buckets_matches_gloo(plain, world):
    from torch.nn.parallel import DistributedDataParallel as DDP
    gloo = dist.new_group(backend="gloo")

    def train(group):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(10, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        ddp = DDP(model, process_group=group, bucket_cap_mb=0.001)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(10 + world.rank)
        for _ in range(5):
            x = torch.randn(8, 10, generator=gen)
            loss = (ddp(x) - x[:, :1]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    ref = train(gloo)
    ours = train(plain)
    assert_close_all(ours, ref.numpy(), atol=1e-6, what="DDP on mpicomm (async buckets) vs gloo")


def test_a_blocking_call_returns_a_completed_work(plain, world):
    """A blocking call (asyncOp False) on the group returns its work completed, with the
    results in place and every method of a work (reference: numpy's sum)."""
    t = torch.full((3,), float(world.rank + 1))
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    work = plain.allreduce([t], opts)
    done_at_return = work.is_completed()
    want = np.full(3, world.size * (world.size + 1) / 2)
    assert_close_all(t, want)
    got = work.get_future().wait()
    ok = (done_at_return and work.is_success() and work.exception() is None and work.wait()
          and work.result()[0] is t and got[0] is t and "completed" in repr(work))
    assert_all(ok, f"completed at return {done_at_return}, {work!r}, future {got}")


def test_a_blocking_call_waiting_for_a_late_peer_completes(plain, world):
    """A blocking call whose peer comes long after the spin (the caller then keeps the deadline
    and yields between tests) completes with the right result (reference: numpy's sum)."""
    if world.size == 1:
        pytest.skip("needs 2 ranks")
    import time
    t = torch.full((4,), float(world.rank + 1))
    world.Barrier()
    if world.rank == world.size - 1:
        time.sleep(0.3)
    dist.all_reduce(t)
    assert_close_all(t, np.full(4, world.size * (world.size + 1) / 2))


def test_wait_with_a_timeout_raises_and_the_call_goes_on(plain, world):
    if world.size == 1:
        pytest.skip("needs 2 ranks")
    store = dist.distributed_c10d._get_default_store()
    t = torch.full((1024,), float(world.rank + 1))
    if world.rank == world.size - 1:
        store.wait([f"waited/{r}" for r in range(world.size - 1)])  # every other rank timed out
        work = dist.all_reduce(t, async_op=True)
        raised = True
    else:
        work = dist.all_reduce(t, async_op=True)
        raised = False
        try:
            work.wait(datetime.timedelta(milliseconds=200))
        except mpicomm.WaitTimeoutError as exc:
            raised = "wait(timeout=0.2 s)" in str(exc)
        store.set(f"waited/{world.rank}", "1")
    assert_all(raised, "wait(timeout) before the last rank joined must raise")
    assert_all(work.wait(), "the call completes afterwards")
    assert_close_all(t[:3], np.full(3, world.size * (world.size + 1) / 2))


def test_object_collectives_batched_p2p_and_coalescing(plain, world):
    r, n = world.rank, world.size
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "name": f"r{r}"})
    assert_all(objs == [{"rank": i, "name": f"r{i}"} for i in range(n)], str(objs))
    lst = [r, "mine"]
    dist.broadcast_object_list(lst, src=n - 1)
    assert_all(lst == [n - 1, "mine"], str(lst))
    got = torch.empty(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(r)), (r + 1) % n),
           dist.P2POp(dist.irecv, got, (r - 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert_close_all(got, np.full(2, float((r - 1) % n)))
    a, b = torch.ones(3), torch.full((2,), float(r))
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    assert_close_all(torch.cat([a, b]), np.r_[np.full(3, float(n)), np.full(2, n * (n - 1) / 2)])
    out = torch.empty((r + 1) * n)
    dist.all_to_all_single(out, _rows_for(r, n), output_split_sizes=[r + 1] * n, input_split_sizes=list(range(1, n + 1)))
    assert_close_all(out, np.concatenate([np.full(r + 1, 10.0 * j + r) for j in range(n)]))


def _rows_for(r: int, n: int) -> torch.Tensor:
    """Rank r sends j + 1 copies of 10 r + j to rank j."""
    return torch.cat([torch.full((j + 1,), float(10 * r + j)) for j in range(n)])


def test_process_group_calls_appear_in_the_profiler(plain, world):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(torch.ones(8))
        dist.all_gather_into_tensor(torch.empty(2 * world.size), torch.ones(2), async_op=True).wait()
        dist.broadcast(torch.ones(2), 0)
    names = {e.name for e in prof.events()}
    want = {"mpicomm:all_reduce", "mpicomm:all_gather_into_tensor", "mpicomm:broadcast"}
    assert_all(want <= names, f"missing {sorted(want - names)}")
