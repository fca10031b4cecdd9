"""Counts beyond MPI's 32-bit limit: with an artificial limit of a few elements every collective and
point-to-point call takes the split / derived-datatype path, and must still match numpy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cco_data import reduce_ref, to_f64, values
from mpicomm import large
from mpitest import assert_all, assert_close_all

pytestmark = pytest.mark.mpi(min_size=1)

LIMIT = 3
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.int64, torch.int8, torch.bool]
IDS = [str(d)[6:] for d in DTYPES]


@pytest.fixture
def tiny_limit(monkeypatch):
    """MAX_COUNT = 3 and a record of which large-count helpers ran."""
    used = []
    monkeypatch.setattr(large, "MAX_COUNT", LIMIT)
    for name in ("piece", "move_spec", "alltoallw_specs", "reduce_scatter_pieces"):
        real = getattr(large, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            used.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(large, name, spy)
    return used


def _t(data, dtype):
    return torch.from_numpy(np.asarray(data, dtype=np.float64).copy()).to(dtype)


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "prod", "band", "bor", "bxor"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_reductions_in_pieces(comm, tiny_limit, dtype, op, async_op):
    floating = dtype.is_floating_point
    if (op == "avg" and not floating) or (op in ("band", "bor", "bxor") and floating):
        pytest.skip("not a valid combination (test_cco_errors)")
    n, k = comm.size, 5
    world = comm.mpi_comm
    x = _t(values(comm.rank, 11, dtype, positive=op == "prod"), dtype)
    stack = np.stack(world.allgather(to_f64(x)))
    ref = _reference(stack, op, dtype)
    work = comm.all_reduce(x, op=op, async_op=async_op)
    if async_op:
        work.wait()
    assert_close_all(to_f64(x), ref, rtol=2 ** -8, what=f"all_reduce {op}")

    y = _t(values(comm.rank, 11, dtype, seed=1, positive=op == "prod"), dtype)
    before = to_f64(y)
    ref = _reference(np.stack(world.allgather(before)), op, dtype)
    work = comm.reduce(y, dst=n - 1, op=op, async_op=async_op)
    if async_op:
        work.wait()
    assert_close_all(to_f64(y), ref if comm.rank == n - 1 else before, rtol=2 ** -8,
                     what=f"reduce {op}")

    z = _t(values(comm.rank, k * n, dtype, seed=2, positive=op == "prod"), dtype)
    out = torch.zeros(k, dtype=dtype)
    ref = _reference(np.stack(world.allgather(to_f64(z))), op, dtype)[comm.rank * k:][:k]
    work = comm.reduce_scatter_tensor(out, z, op=op, async_op=async_op)
    if async_op:
        work.wait()
    assert_close_all(to_f64(out), ref, rtol=2 ** -8, what=f"reduce_scatter {op}")
    if dtype == torch.bfloat16 and op != "prod":
        return  # 16 bits on the wire in bounded segments (mpicomm.reduce16): never in pieces
    assert_all({"piece", "reduce_scatter_pieces"} <= set(tiny_limit), str(tiny_limit))


def _reference(stack, op, dtype):
    if op in ("band", "bor", "bxor"):
        ints = stack.astype(np.int64)
        fn = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
        return fn.reduce(ints, axis=0).astype(np.float64)
    return reduce_ref(stack, op, dtype == torch.bool)


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float8_e4m3fn], ids=IDS + ["float8_e4m3fn"])
def test_moves_with_derived_datatypes(comm, tiny_limit, dtype, async_op):
    n, k = comm.size, 7  # 7 = 2 blocks of 3 + 1: a struct of a nested contiguous and a tail
    world = comm.mpi_comm
    f8 = dtype == torch.float8_e4m3fn
    mk = (lambda a: _t(a, torch.float32).to(dtype)) if f8 else (lambda a: _t(a, dtype))

    def done(work):
        if async_op:
            work.wait()

    x = mk(values(comm.rank, k, torch.int8, seed=3))
    ref = world.bcast(to_f64(x), root=n - 1)
    done(comm.broadcast(x, src=n - 1, async_op=async_op))
    assert_close_all(to_f64(x), ref, what="broadcast")

    x = mk(values(comm.rank, k, torch.int8, seed=4))
    out = mk(np.zeros(k * n))
    ref = np.concatenate(world.allgather(to_f64(x)))
    done(comm.all_gather_into_tensor(out, x, async_op=async_op))
    assert_close_all(to_f64(out), ref, what="all_gather_into_tensor")

    outs = [mk(np.zeros(k)) for _ in range(n)]
    done(comm.all_gather(outs, x, async_op=async_op))
    assert_close_all(np.concatenate([to_f64(o) for o in outs]), ref, what="all_gather")

    x = mk(values(comm.rank, k * n, torch.int8, seed=5))
    out = mk(np.zeros(k * n))
    everyone = world.allgather(to_f64(x))
    done(comm.all_to_all_single(out, x, async_op=async_op))
    assert_close_all(to_f64(out), np.concatenate([e[comm.rank * k:][:k] for e in everyone]),
                     what="all_to_all_single")

    # uneven splits: rank r sends (j + r + 1) * 4 elements to rank j (counts and displacements > LIMIT)
    send_splits = [4 * (j + comm.rank + 1) for j in range(n)]
    recv_splits = [4 * (comm.rank + r + 1) for r in range(n)]
    x = mk(values(comm.rank, sum(send_splits), torch.int8, seed=6))
    out = mk(np.zeros(sum(recv_splits)))
    everyone = world.allgather(to_f64(x))
    done(comm.all_to_all_single(out, x, recv_splits, send_splits, async_op=async_op))
    pieces = [everyone[r][sum(4 * (j + r + 1) for j in range(comm.rank)):][:recv_splits[r]]
              for r in range(n)]
    assert_close_all(to_f64(out), np.concatenate(pieces), what="all_to_all_single (splits)")

    x = mk(values(comm.rank, k, torch.int8, seed=7))
    everyone = world.allgather(to_f64(x))
    gl = [mk(np.zeros(k)) for _ in range(n)] if comm.rank == 0 else None
    done(comm.gather(x, gl, dst=0, async_op=async_op))
    if comm.rank == 0:
        assert_close_all(np.stack([to_f64(g) for g in gl]), np.stack(everyone), what="gather")
    else:
        assert_all(True)
    y = mk(np.zeros(k))
    done(comm.scatter(y, gl, src=0, async_op=async_op))
    assert_close_all(to_f64(y), everyone[comm.rank], what="scatter")
    assert_all({"move_spec", "alltoallw_specs"} <= set(tiny_limit), str(tiny_limit))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
def test_point_to_point_with_derived_datatypes(comm, tiny_limit, async_op):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    x = torch.arange(10, dtype=torch.int32) + 100 * comm.rank
    got = torch.zeros(10, dtype=torch.int32)
    if async_op:
        works = [comm.irecv(got, src=left), comm.isend(x, dst=right)]
        for w in works:
            w.wait()
    elif comm.rank % 2 == 0:
        comm.send(x, dst=right)
        assert comm.recv(got, src=None) == left
    else:
        assert comm.recv(got, src=left) == left
        comm.send(x, dst=right)
    assert_close_all(got, np.arange(10) + 100 * left)
    assert_all("move_spec" in tiny_limit, str(tiny_limit))


def test_derived_datatype_covers_exactly_count_elements(monkeypatch):
    from mpi4py import MPI

    monkeypatch.setattr(large, "MAX_COUNT", LIMIT)
    for count in (1, 3, 4, 9, 10, 28, 29):
        t = large.contiguous(MPI.INT32_T, count)
        assert t.Get_size() == 4 * count and t.Get_extent() == (0, 4 * count), count
    assert large.too_big(LIMIT + 1) and not large.too_big(LIMIT, 0)
