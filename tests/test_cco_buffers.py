"""Buffers that need adapting: non-contiguous, requires-grad, read-only, aliased, async, p2p, groups."""
from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch

import mpicomm
from mpitest import assert_all, assert_close_all, check_all

pytestmark = pytest.mark.mpi(min_size=1)


def test_non_contiguous_all_reduce_lands_in_callers_tensor(comm):
    base = torch.arange(24, dtype=torch.float32).view(4, 6) + comm.rank
    view = base[:, 1::2]  # strided view
    untouched = base[:, 0::2].clone()
    comm.all_reduce(view)
    expected = (torch.arange(24, dtype=torch.float64).view(4, 6)[:, 1::2] * comm.size
                + sum(range(comm.size)))
    assert_close_all(view, expected.numpy())
    assert_close_all(base[:, 0::2], untouched.numpy(), what="elements outside the view")


def test_non_contiguous_bf16_avg_and_transposed_gather(comm, world):
    x = (torch.arange(12, dtype=torch.float32).view(3, 4).t() + comm.rank).to(torch.bfloat16)
    comm.all_reduce(x, op=mpicomm.ReduceOp.AVG)
    expected = torch.arange(12, dtype=torch.float64).view(3, 4).t() + (comm.size - 1) / 2
    assert_close_all(x, expected.to(torch.bfloat16).double().numpy(), rtol=2 ** -8)
    inp = torch.arange(6.0).view(2, 3).t() + 10 * comm.rank  # non-contiguous input
    out = torch.empty(comm.size * 3, 2).t()  # non-contiguous output
    comm.all_gather_into_tensor(out, inp)
    everyone = np.concatenate(world.allgather(inp.contiguous().numpy().ravel()))
    assert_close_all(out.contiguous().view(-1), everyone)


def test_requires_grad_tensors(comm):
    w = torch.ones(5, requires_grad=True)
    comm.all_reduce(w)  # works on the leaf's data
    assert_close_all(w, np.full(5, float(comm.size)))
    assert_all(w.requires_grad and w.grad_fn is None, "w lost requires_grad or got a grad_fn")
    y = torch.ones(4, requires_grad=True) * 2  # non-leaf with grad_fn
    out = torch.empty(4 * comm.size)
    comm.all_gather_into_tensor(out, y)
    assert_close_all(out, np.full(4 * comm.size, 2.0))


def test_read_only_numpy_input_is_fine_but_not_as_output(comm):
    src = np.arange(4.0)
    src.setflags(write=False)
    out = np.empty(4 * comm.size)
    comm.all_gather_into_tensor(out, src)
    assert_close_all(out, np.tile(np.arange(4.0), comm.size))
    with pytest.raises(ValueError, match="writable"):
        comm.all_reduce(src)
    check_all(lambda: None)


def test_in_place_all_gather_from_own_slot(comm):
    n = 3
    flat = torch.full((comm.size * n,), -1.0)
    flat[comm.rank * n:(comm.rank + 1) * n] = comm.rank
    comm.all_gather_into_tensor(flat, flat[comm.rank * n:(comm.rank + 1) * n])
    assert_close_all(flat, np.repeat(np.arange(comm.size, dtype=np.float64), n))


def test_aliased_reduce_scatter_output(comm):
    n = 4
    flat = torch.arange(comm.size * n, dtype=torch.float64) + comm.rank
    expected = (np.arange(comm.size * n) * comm.size + sum(range(comm.size)))[comm.rank * n:(comm.rank + 1) * n]
    comm.reduce_scatter_tensor(flat[:n], flat)  # output overlaps the input
    assert_close_all(flat[:n], expected)


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather_into_tensor",
                                "reduce_scatter_tensor", "all_to_all_single", "barrier"])
def test_async_matches_blocking(comm, op):
    def args():
        x = torch.arange(4 * comm.size, dtype=torch.float32) + comm.rank
        if op == "all_reduce":
            return (x,), x
        if op == "broadcast":
            return (x, 0), x
        if op == "all_gather_into_tensor":
            o = torch.empty(4 * comm.size * comm.size)
            return (o, x), o
        if op == "reduce_scatter_tensor":
            o = torch.empty(4)
            return (o, x), o
        if op == "all_to_all_single":
            o = torch.empty(4 * comm.size)
            return (o, x), o
        return (), None

    a, ref = args()
    getattr(comm, op)(*a)
    b, out = args()
    work = getattr(comm, op)(*b, async_op=True)
    assert isinstance(work, mpicomm.Work)
    assert work.wait() is True and work.is_completed()
    if ref is not None:
        assert_close_all(out, ref.numpy())


def test_async_results_land_only_at_completion(comm):
    # a non-contiguous bf16 buffer goes through an upcast copy: the caller's tensor must keep its
    # old contents until the work completes, then hold the result.
    base = torch.ones(8, 2, dtype=torch.bfloat16)
    view = base[:, 0]
    work = comm.all_reduce(view, op="sum", async_op=True)
    before = base[:, 0].float().clone()
    fut = work.get_future()
    work.wait()
    assert_close_all(before, np.ones(8), what="result landed before completion")
    assert_close_all(view, np.full(8, float(comm.size)))
    fut.wait()
    check_all(lambda: np.testing.assert_equal(fut.done(), True))


def test_future_completes_without_explicit_wait(comm):
    x = torch.ones(1000)
    fut = comm.all_reduce(x, async_op=True).get_future()
    result = fut.wait()  # completed by the work's waiter thread
    assert_close_all(result[0], np.full(1000, float(comm.size)))


def test_wait_with_a_timeout_raises_and_the_operation_goes_on(comm):
    # every rank times out before the barrier, and sends only after it: nothing can have arrived
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = torch.zeros(3)
    work = comm.irecv(got, src=left, tag=7)
    with pytest.raises(mpicomm.WaitTimeoutError, match=r"wait\(timeout=0.05 s\); it goes on"):
        work.wait(0.05)
    with pytest.raises(ValueError, match="timeout"):
        work.wait(-1)
    assert not work.is_completed() and work.exception() is None
    comm.barrier()
    comm.send(torch.full((3,), float(comm.rank)), dst=right, tag=7)
    assert work.wait(datetime.timedelta(seconds=60)) is True and work.is_success()
    assert work.result() == [got] and work.source_rank() == left
    assert_close_all(got, np.full(3, float(left)))


def test_many_outstanding_async_ops(comm):
    xs = [torch.full((10,), float(i + comm.rank)) for i in range(8)]
    works = [comm.all_reduce(x, async_op=True) for x in xs]
    for w in reversed(works):
        w.wait()
    expected = [np.full(10, i * comm.size + sum(range(comm.size))) for i in range(8)]
    assert_close_all(np.stack([x.numpy() for x in xs]), np.stack(expected))


def test_point_to_point_ring(comm):
    right = (comm.rank + 1) % comm.size
    left = (comm.rank - 1) % comm.size
    send = torch.arange(5, dtype=torch.int64) + 100 * comm.rank
    recv = torch.empty(5, dtype=torch.int64)
    rw = comm.irecv(recv, src=left, tag=7)
    sw = comm.isend(send, dst=right, tag=7)
    sw.wait()
    rw.wait()
    assert_close_all(recv, (np.arange(5) + 100 * left))
    # blocking pair, any-source receive reports the sender
    if comm.size > 1:
        if comm.rank == 0:
            got = torch.empty(3)
            sender = comm.recv(got, src=None, tag=3)
            ok = sender == 1 and got.tolist() == [1.0, 2.0, 3.0]
        elif comm.rank == 1:
            comm.send(torch.tensor([1.0, 2.0, 3.0]), dst=0, tag=3)
            ok = True
        else:
            ok = True
        assert_all(ok, "blocking send/recv pair failed")


def test_split_communicators(comm, world):
    color = comm.rank % 2
    sub = comm.split(color, key=-comm.rank)  # reversed order inside each group
    members = [r for r in range(comm.size) if r % 2 == color]
    assert_all(sub.size == len(members), f"sub size {sub.size} != {len(members)}")
    assert_all(sub.rank == sorted(members, reverse=True).index(comm.rank), "key order ignored")
    x = torch.tensor([float(comm.rank)])
    sub.all_reduce(x)
    assert_close_all(x, np.array([float(sum(members))]))
    none = comm.split(None if comm.rank == 0 else 1)
    assert_all((none is None) == (comm.rank == 0), "split(None) must give None")
    if none is not None:
        none.free()
    sub.free()


@pytest.mark.slow
def test_count_above_2_31_elements(comm):
    # Runs on MPI-4 libraries natively and on MPI-3 ones (Open MPI 5) through mpicomm.large.
    if comm.size > 2:
        pytest.skip("needs 2 GiB per rank: run at 1 or 2 ranks")
    n = 2 ** 31 + 8
    x = torch.ones(n, dtype=torch.int8)
    x[-1] = 2
    comm.all_reduce(x)
    ok = int(x[0]) == comm.size and int(x[-1]) == 2 * comm.size and int(x[2 ** 31 + 1]) == comm.size
    problems = [] if ok else [f"all_reduce: {x[0]}, {x[2 ** 31 + 1]}, {x[-1]}"]
    comm.all_reduce(x, op="max", async_op=True).wait()  # values were already equal everywhere
    if not (int(x[1]) == comm.size and int(x[-1]) == 2 * comm.size):
        problems.append(f"async all_reduce: {x[1]}, {x[-1]}")
    x[-1] = 7 + comm.rank
    comm.broadcast(x, src=comm.size - 1)
    if int(x[-1]) != 6 + comm.size or int(x[-2]) != comm.size:
        problems.append(f"broadcast: {x[-2]}, {x[-1]}")
    del x
    assert_all(not problems, f"wrong values past 2^31 elements: {problems}")
