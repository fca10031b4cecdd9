"""Every collective x dtype x (torch, numpy), checked against numpy on the gathered inputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mpicomm
from cco_data import (FLOAT_TORCH, NUMPY_DTYPES, TORCH_DTYPES, make, reduce_ref, to_f64, tolerance,
                      values)
from mpitest import assert_all, assert_close_all

pytestmark = pytest.mark.mpi(min_size=1)

CASES = [("torch", d) for d in TORCH_DTYPES] + [("numpy", d) for d in NUMPY_DTYPES]
IDS = [f"{fw}-{str(d).replace('torch.', '').replace('<class ', '').strip('>').replace('numpy.', '')}"
       for fw, d in CASES]
OPS = ["sum", "avg", "max", "min", "prod", "band", "bor", "bxor"]


def _is_float(dtype) -> bool:
    return dtype in FLOAT_TORCH or (not isinstance(dtype, torch.dtype) and np.dtype(dtype).kind == "f")


def _is_bool(dtype) -> bool:
    return dtype in (torch.bool, np.bool_)


def _gather_f64(world, arr) -> np.ndarray:
    return np.stack(world.allgather(to_f64(arr)))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("fw,dtype", CASES, ids=IDS)
def test_all_reduce(comm, world, fw, dtype, op):
    if op == "avg" and not _is_float(dtype):
        pytest.skip("AVG on integers is an error (tested in test_cco_errors)")
    if op.startswith("b") and _is_float(dtype):
        pytest.skip("bitwise ops on floating dtypes are an error (tested in test_cco_errors)")
    x = make(fw, values(comm.rank, 37, dtype, positive=op == "prod"), dtype, (37,))
    stack = _gather_f64(world, x)
    assert comm.all_reduce(x, op=op) is None
    expected = reduce_ref(stack, op, _is_bool(dtype))
    assert_close_all(to_f64(x), expected, rtol=tolerance(dtype), what=f"all_reduce {op}")


@pytest.mark.parametrize("op", ["sum", "avg", "max", "bxor"])
@pytest.mark.parametrize("fw,dtype", CASES, ids=IDS)
def test_reduce_scatter_tensor(comm, world, fw, dtype, op):
    if op == "avg" and not _is_float(dtype):
        pytest.skip("AVG on integers is an error")
    if op == "bxor" and _is_float(dtype):
        pytest.skip("bitwise ops on floating dtypes are an error")
    n = 5
    x = make(fw, values(comm.rank, n * comm.size, dtype), dtype, (comm.size * n,))
    out = make(fw, np.zeros(n), dtype)
    stack = _gather_f64(world, x)
    comm.reduce_scatter_tensor(out, x, op=op)
    expected = reduce_ref(stack, op, _is_bool(dtype))[comm.rank * n:(comm.rank + 1) * n]
    assert_close_all(to_f64(out), expected, rtol=tolerance(dtype))


@pytest.mark.parametrize("op", ["sum", "max", "band"])
@pytest.mark.parametrize("fw,dtype", CASES[:4] + CASES[-3:], ids=IDS[:4] + IDS[-3:])
def test_reduce_to_root(comm, world, fw, dtype, op):
    if op == "band" and _is_float(dtype):
        pytest.skip("bitwise ops on floating dtypes are an error")
    root = comm.size - 1
    x = make(fw, values(comm.rank, 11, dtype), dtype)
    before = to_f64(x)
    stack = _gather_f64(world, x)
    comm.reduce(x, dst=root, op=op)
    expected = reduce_ref(stack, op, _is_bool(dtype)) if comm.rank == root else before
    assert_close_all(to_f64(x), expected, rtol=tolerance(dtype))


@pytest.mark.parametrize("call", ["all_reduce", "reduce", "reduce_scatter_tensor"])
@pytest.mark.parametrize("fw,dtype", [("torch", torch.float64), ("torch", torch.float32),
                                      ("torch", torch.int32), ("numpy", np.float32)],
                         ids=["torch-float64", "torch-float32", "torch-int32", "numpy-float32"])
def test_factor_scales_each_rank_before_the_sum(comm, world, fw, dtype, call):
    """PREMUL_SUM (``factor=``) of dtypes other than 16-bit: each rank's values times the factor
    in their dtype, then summed (16-bit tensors: test_cco_reduce16); the inputs that are not
    results keep their values (reduce's other ranks, reduce_scatter's input)."""
    n, root = 6, comm.size - 1
    factor = 3 if dtype == torch.int32 else torch.tensor(0.5)
    x = make(fw, values(comm.rank, n * comm.size, dtype, seed=5), dtype)
    before = to_f64(x)
    scaled = np.stack(world.allgather(to_f64(x) * float(factor)))
    out = make(fw, np.zeros(n), dtype)
    if call == "all_reduce":
        comm.all_reduce(x, factor=factor)
        got, want = to_f64(x), scaled.sum(0)
    elif call == "reduce":
        comm.reduce(x, dst=root, factor=factor)
        got, want = to_f64(x), scaled.sum(0) if comm.rank == root else before
    else:
        comm.reduce_scatter_tensor(out, x, factor=factor)
        got, want = to_f64(out), scaled.sum(0)[comm.rank * n:(comm.rank + 1) * n]
        assert_all(np.array_equal(to_f64(x), before), f"input changed: {x}")
    assert_close_all(got, want, rtol=tolerance(dtype), what=f"{call} factor={factor}")


@pytest.mark.parametrize("fw,dtype", CASES, ids=IDS)
def test_broadcast(comm, world, fw, dtype):
    src = comm.size // 2
    x = make(fw, values(comm.rank, 13, dtype, seed=3), dtype, (13,))
    expected = world.bcast(to_f64(x), root=src)
    comm.broadcast(x, src=src)
    assert_close_all(to_f64(x), expected)


@pytest.mark.parametrize("fw,dtype", CASES, ids=IDS)
def test_all_gather_into_tensor(comm, world, fw, dtype):
    x = make(fw, values(comm.rank, 6, dtype), dtype, (2, 3))
    out = make(fw, np.zeros(comm.size * 6), dtype, (comm.size * 2, 3))
    expected = np.concatenate(world.allgather(to_f64(x)))
    comm.all_gather_into_tensor(out, x)
    assert_close_all(to_f64(out), expected)


@pytest.mark.parametrize("fw,dtype", CASES[:3] + CASES[-2:], ids=IDS[:3] + IDS[-2:])
def test_all_gather_list(comm, world, fw, dtype):
    x = make(fw, values(comm.rank, 4, dtype), dtype)
    outs = [make(fw, np.zeros(4), dtype) for _ in range(comm.size)]
    expected = world.allgather(to_f64(x))
    comm.all_gather(outs, x)
    assert_close_all(np.stack([to_f64(o) for o in outs]), np.stack(expected))


@pytest.mark.parametrize("fw,dtype", CASES, ids=IDS)
def test_all_to_all_single(comm, world, fw, dtype):
    k = 3
    x = make(fw, values(comm.rank, k * comm.size, dtype, seed=5), dtype)
    out = make(fw, np.zeros(k * comm.size), dtype)
    everyone = world.allgather(to_f64(x))
    comm.all_to_all_single(out, x)
    expected = np.concatenate([everyone[r][comm.rank * k:(comm.rank + 1) * k] for r in range(comm.size)])
    assert_close_all(to_f64(out), expected)


def test_all_to_all_single_uneven_splits(comm, world):
    # rank r sends (j + r + 1) rows of 2 elements to rank j
    send_splits = [j + comm.rank + 1 for j in range(comm.size)]
    recv_splits = [comm.rank + r + 1 for r in range(comm.size)]
    x = torch.arange(sum(send_splits) * 2, dtype=torch.float32).view(-1, 2) + 1000 * comm.rank
    out = torch.full((sum(recv_splits), 2), -1.0)
    everyone = world.allgather(x.numpy().copy())
    comm.all_to_all_single(out, x, output_split_sizes=recv_splits, input_split_sizes=send_splits)
    pieces = []
    for r in range(comm.size):
        start = sum(j + r + 1 for j in range(comm.rank))
        pieces.append(everyone[r][start:start + comm.rank + r + 1])
    assert_close_all(out, np.concatenate(pieces))


@pytest.mark.parametrize("fw,dtype", CASES[:4] + CASES[-2:], ids=IDS[:4] + IDS[-2:])
def test_gather_and_scatter(comm, world, fw, dtype):
    root = comm.size - 1
    x = make(fw, values(comm.rank, 7, dtype), dtype)
    gl = [make(fw, np.zeros(7), dtype) for _ in range(comm.size)] if comm.rank == root else None
    everyone = world.allgather(to_f64(x))
    comm.gather(x, gl, dst=root)
    if comm.rank == root:
        assert_close_all(np.stack([to_f64(g) for g in gl]), np.stack(everyone))
    else:
        assert_close_all(np.zeros(1), np.zeros(1))  # keep the collective assertion aligned
    # scatter them back from the root: rank r gets everyone[r]
    y = make(fw, np.zeros(7), dtype)
    comm.scatter(y, gl, src=root)
    assert_close_all(to_f64(y), everyone[comm.rank])


def test_module_functions_use_the_world(comm, world):
    mpicomm.init()
    x = torch.full((3,), float(comm.rank + 1))
    mpicomm.all_reduce(x)
    assert_close_all(x, np.full(3, comm.size * (comm.size + 1) / 2))
    out = torch.empty(comm.size)
    mpicomm.all_gather_into_tensor(out, torch.tensor([float(comm.rank)]))
    assert_close_all(out, np.arange(comm.size))
    assert mpicomm.get_rank() == world.rank and mpicomm.get_world_size() == world.size
    mpicomm.barrier()


def test_empty_buffers(comm):
    # Zero-element calls complete, leave the buffers empty and keep the communicator in step:
    # a following collective on real data still gives the right answer on every rank.
    x = torch.empty(0)
    comm.all_reduce(x)
    out = torch.empty(0)
    comm.all_gather_into_tensor(out, torch.empty(0))
    y = torch.empty(0, 3)
    comm.broadcast(y, src=comm.size - 1)
    work = comm.all_reduce(torch.empty(0, dtype=torch.int64), async_op=True)
    assert_all(work.wait() is True and x.shape == (0,) and out.shape == (0,) and y.shape == (0, 3),
               f"shapes after empty calls: {x.shape}, {out.shape}, {y.shape}")
    z = torch.full((2,), float(comm.rank + 1))
    comm.all_reduce(z)
    assert_close_all(z, np.full(2, comm.size * (comm.size + 1) / 2))
