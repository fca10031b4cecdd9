"""bfloat16/float16 reductions (mpicomm.reduce16): every op, both dtypes, 1-4 ranks, both paths.

The reference is numpy alone: the ranks' 16-bit values summed in float32 in rank order (or
max/min), scaled in float32 (AVG, PREMUL_SUM), rounded once to 16 bits. The pipelined path is
forced with tiny thresholds (segments of 3 elements), so sizes below the rank count, sizes not
divisible by it, empty owner blocks and many segments all run.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from mpicomm import kernels16, reduce16
from mpitest import assert_all

pytestmark = pytest.mark.mpi(min_size=1)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
OPS = ("sum", "avg", "max", "min", "premul")
FACTOR = 0.3


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def _round(x32: np.ndarray, name: str) -> np.ndarray:
    """float32 -> 16-bit bit patterns, round to nearest even (numpy alone)."""
    if name == "float16":
        return x32.astype(np.float16).view(np.uint16)
    u = x32.astype(np.float32).view(np.uint32)
    return ((u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16).astype(np.uint16)


def _value(bits: np.ndarray, name: str) -> np.ndarray:
    if name == "float16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def reference(rows: np.ndarray, name: str, op: str) -> np.ndarray:
    """rows: [p, n] 16-bit bit patterns in rank order -> the expected bits."""
    vals = [_value(r, name) for r in rows]
    acc = vals[0].copy()
    for v in vals[1:]:
        if op in ("max", "min"):
            acc = np.maximum(acc, v) if op == "max" else np.minimum(acc, v)
        else:
            acc = acc + v  # float32 + float32, in rank order
    if op == "avg":
        acc = acc / np.float32(len(rows))
    elif op == "premul":
        acc = acc * np.float32(FACTOR)
    return _round(acc.astype(np.float32), name)


def per_step(rows: np.ndarray, name: str) -> np.ndarray:
    """A sum rounded to 16 bits after every addition (what one rounding must differ from)."""
    acc = rows[0]
    for r in rows[1:]:
        acc = _round(_value(acc, name) + _value(r, name), name)
    return acc


def inputs(rank: int, n: int, name: str, seed: int) -> torch.Tensor:
    """Values of mixed magnitude (so that rounding once and rounding per step differ)."""
    g = np.random.default_rng(seed * 1000 + rank)
    x = g.standard_normal(n).astype(np.float32) * np.float32(2.0) ** g.integers(-3, 6, n)
    return torch.from_numpy(x).to(DTYPES[name])


@pytest.fixture(scope="module")
def subcomms(comm):
    """Communicators of 1..world ranks (ranks below the size are members), at most 4."""
    out = {}
    for size in range(1, min(comm.size, 4) + 1):
        out[size] = comm.split(0 if comm.rank < size else None)
    yield out
    for c in out.values():
        if c is not None:
            c.free()


@pytest.fixture(params=["small", "pipelined", "small-torch", "pipelined-torch"])
def path(request, monkeypatch):
    """The one-collective or the pipelined path, on host buffers (numpy views, the host kernel)
    or through the device-buffer code (torch views, raw addresses, torch kernels) that device
    tensors take when MPI is CUDA-aware."""
    if request.param.startswith("pipelined"):
        monkeypatch.setattr(reduce16, "SMALL_BYTES", 0)
        monkeypatch.setattr(reduce16, "SEGMENT_BYTES", 6)  # 3 elements per segment
    else:
        monkeypatch.setattr(reduce16, "SMALL_BYTES", 1 << 30)
    monkeypatch.setattr(reduce16, "TORCH_BUFFERS", request.param.endswith("-torch"))
    return request.param


def _sizes(p: int) -> list[int]:
    """Smaller than p (1 at p = 1), not divisible by p, and one with many segments."""
    return sorted({max(p - 1, 1), 7 * p + 2, 64})


def _start(c, call: str, op: str, x, out, dst: int, async_op: bool):
    factor = FACTOR if op == "premul" else None
    ours = "sum" if op == "premul" else op
    if call == "all_reduce":
        return c.all_reduce(x, ours, async_op, factor=factor)
    if call == "reduce":
        return c.reduce(x, dst, ours, async_op, factor=factor)
    return c.reduce_scatter_tensor(out, x, ours, async_op, factor=factor)


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("call", ["all_reduce", "reduce_scatter_tensor", "reduce"])
def test_against_numpy(comm, world, subcomms, path, call, name):
    bad = []
    for p, c in subcomms.items():
        for seed, n in enumerate(_sizes(p)):
            total = n * p if call == "reduce_scatter_tensor" else n
            for op in OPS:
                for async_op in (False, True) if n == 7 * p + 2 else (False,):
                    if c is None:
                        continue
                    x = inputs(c.rank, total, name, seed)
                    rows = np.stack(c.mpi_comm.allgather(_bits(x)))
                    want = reference(rows, name, op)
                    before = _bits(x)
                    out = torch.full((n,), 7.0, dtype=DTYPES[name])
                    dst = p - 1
                    work = _start(c, call, op, x, out, dst, async_op)
                    if async_op:
                        work.wait()
                    else:
                        assert work is None
                    if call == "all_reduce":
                        got, exp = _bits(x), want
                    elif call == "reduce_scatter_tensor":
                        got, exp = _bits(out), want[c.rank * n:(c.rank + 1) * n]
                    else:
                        got, exp = _bits(x), want if c.rank == dst else before
                    if not np.array_equal(got, exp):
                        where = np.flatnonzero(got != exp)[:4]
                        bad.append(f"p={p} n={n} {op} async={async_op}: at {where.tolist()} "
                                   f"got {got[where].tolist()} want {exp[where].tolist()}")
    assert_all(not bad, "; ".join(bad[:3]), world)


def test_one_rounding_differs_from_per_step_rounding(world):
    """The inputs above tell one rounding apart from a 16-bit running sum (the test can fail)."""
    rows = np.stack([_bits(inputs(r, 64, "bfloat16", 3)) for r in range(3)])
    assert np.count_nonzero(reference(rows, "bfloat16", "sum") != per_step(rows, "bfloat16"))


@pytest.mark.parametrize("name", list(DTYPES))
def test_async_calls_waited_out_of_order(comm, world, path, name):
    """Several pipelined calls in flight, completed in reverse order and by is_completed()."""
    xs = [inputs(comm.rank, 50 + 3 * i, name, 40 + i) for i in range(3)]
    wants = [reference(np.stack(world.allgather(_bits(x))), name, "sum") for x in xs]
    works = [comm.all_reduce(x, async_op=True) for x in xs]
    works[2].wait()
    while not works[1].is_completed():
        pass
    works[0].wait()
    ok = all(np.array_equal(_bits(x), w) for x, w in zip(xs, wants))
    assert_all(ok, "async results differ from numpy", world)


@pytest.mark.parametrize("name", list(DTYPES))
def test_non_contiguous_and_numpy(comm, world, path, name):
    base = inputs(comm.rank, 24, name, 7).view(4, 6)
    t = base.t()  # non-contiguous
    rows = np.stack(world.allgather(_bits(t)))
    comm.all_reduce(t, op="max")
    ok = np.array_equal(_bits(t), reference(rows, name, "max"))
    if name == "float16":
        arr = inputs(comm.rank, 9, name, 8).numpy()
        rows = np.stack(world.allgather(arr.view(np.uint16).copy()))
        comm.all_reduce(arr, op="avg")
        ok = ok and np.array_equal(arr.view(np.uint16), reference(rows, name, "avg"))
    assert_all(ok, "non-contiguous / numpy results differ from numpy", world)


def test_kernels_agree(monkeypatch):
    """The numba kernel and the torch fallback give the same bits (one process)."""
    pytest.importorskip("numba")
    g = np.random.default_rng(5)
    for name in DTYPES:
        rows = np.stack([_bits(inputs(r, 3000, name, 9)) for r in range(3)])
        rows[1, :4] = _bits(torch.tensor([float("inf"), -float("inf"), 65504.0, 1e-7],
                                         dtype=DTYPES[name]))
        for kind, mode, scale in ((kernels16.SUM, kernels16.PLAIN, 1.0),
                                  (kernels16.SUM, kernels16.DIVIDE, 3.0),
                                  (kernels16.SUM, kernels16.MULTIPLY, 0.7),
                                  (kernels16.MAX, 0, 1.0), (kernels16.MIN, 0, 1.0)):
            outs = []
            for impl in ("numba", "torch"):
                monkeypatch.setattr(kernels16, "_choice", impl)
                if impl == "numba":
                    kernels16._choice = None
                    monkeypatch.delenv("MPICOMM_REDUCE16_KERNELS", raising=False)
                    assert kernels16.implementation() == "numba"
                out = np.empty(rows.shape[1], np.uint16)
                own = rows[int(g.integers(0, 3))].copy()
                me = int(np.flatnonzero((rows == own).all(axis=1))[0])
                kernels16.reduce_rows(rows, own, me, out, name, kind, mode, scale)
                outs.append(out)
            assert np.array_equal(outs[0], outs[1]), (name, kind, mode)
    kernels16._choice = None


def test_float8_and_bitwise_still_errors(comm):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        comm.all_reduce(torch.zeros(4, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="BAND on bfloat16"):
        comm.all_reduce(torch.zeros(4, dtype=torch.bfloat16), op="band")
    with pytest.raises(ValueError, match="BXOR on float16"):
        comm.reduce_scatter_tensor(torch.zeros(1, dtype=torch.float16),
                                   torch.zeros(comm.size, dtype=torch.float16), op="bxor")


def test_prod_keeps_the_float32_path(comm, world):
    x = torch.full((5,), 1.5, dtype=torch.bfloat16)
    comm.all_reduce(x, op="prod")
    ok = bool((x.float() == torch.tensor(1.5) ** comm.size).all()) or comm.size > 5
    assert_all(ok, f"prod gave {x.tolist()}", world)



def test_device_policy_needs_every_call():
    """Device buffers go straight to MPI only when it takes them for every call made here."""
    from mpicomm.device_paths import DevicePolicy

    assert reduce16.device_policy(DevicePolicy(True, "probe")).direct("all_reduce")
    # Open MPI's table refuses non-blocking reductions, which the 16-bit path does not use
    assert reduce16.device_policy(DevicePolicy(True, "probe", {"iallreduce": False})).direct("all_reduce")
    staged = reduce16.device_policy(DevicePolicy(True, "probe", {"ialltoall": False}))
    assert not staged.direct("all_reduce") and "ialltoall" in staged.reason
    assert not reduce16.device_policy(DevicePolicy(None, "unknown")).direct("reduce")
