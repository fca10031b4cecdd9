"""compressed.fsdp.quantize (pure, no MPI) against a float64 numpy simulation of the same
quantization: block edges, tails, segments, bf16 and fp32 inputs, non-finite blocks, the bound."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compressed.fsdp.quantize import dequantize_into, layout, quantize_rows, reduce_rows
from compressed.kernels import ENV


@pytest.fixture(autouse=True, params=["numba", "torch"])
def impl(request, monkeypatch):
    """Every test twice: the numba CPU kernels and the torch ones (what CUDA runs)."""
    if request.param == "numba":
        pytest.importorskip("numba")
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, "numpy")
    return request.param


def simulate(x: np.ndarray, block: int, segments=None) -> np.ndarray:
    """float64 reference: per segment, blocks of ``block``; scale = fp32(max|x| / 127);
    q = clip(round-half-even(x / scale), -127, 127); value = fp32(q * scale)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return _simulate(np.asarray(x, dtype=np.float64), block, segments)


def _simulate(x: np.ndarray, block: int, segments) -> np.ndarray:
    out = np.empty_like(x)
    segments = segments or [x.shape[-1]]
    pos = 0
    for seg in segments:
        for b in range(pos, pos + seg, block):
            e = min(b + block, pos + seg)
            xb = x[:, b:e]
            amax = np.abs(xb).max(axis=1, keepdims=True)
            scale = (amax.astype(np.float32) / np.float32(127.0)).astype(np.float64)
            safe = np.where(scale == 0, 1.0, scale)
            q = np.clip(np.round(xb / safe), -127, 127)
            out[:, b:e] = (q * scale).astype(np.float32)
            bad = ~np.isfinite(xb).all(axis=1)
            out[bad, b:e] = np.nan
        pos += seg
    return out


def _roundtrip(x: torch.Tensor, block: int, segments=None) -> torch.Tensor:
    lay = layout(x.shape[1], block, segments)
    packed = quantize_rows(x, lay)
    assert packed.shape == (x.shape[0], lay.nbytes) and packed.dtype == torch.uint8
    out = torch.empty(x.shape, dtype=torch.float32)
    dequantize_into(packed, lay, out)
    return out


def _compare(got: torch.Tensor, x: torch.Tensor, block: int, segments=None) -> None:
    """Equal to the simulation, except where x / scale sits within fp32 rounding of a tie."""
    ref = simulate(x.double().numpy(), block, segments)
    g = got.double().numpy()
    same = (g == ref) | (np.isnan(g) & np.isnan(ref))
    # near-ties may round the other way in fp32: allowed to differ by one step there only
    xs = x.double().numpy()
    near_tie = np.zeros_like(same)
    segs = segments or [xs.shape[1]]
    pos = 0
    for seg in segs:
        for b in range(pos, pos + seg, block):
            e = min(b + block, pos + seg)
            scale = np.float32(np.abs(xs[:, b:e]).max(axis=1, keepdims=True)) / np.float32(127)
            with np.errstate(invalid="ignore"):
                frac = np.abs(xs[:, b:e] / np.where(scale == 0, 1, scale)) % 1.0
            near_tie[:, b:e] = (np.abs(frac - 0.5) < 1e-4) & \
                (np.abs(g[:, b:e] - ref[:, b:e]) <= scale * 1.0001)
        pos += seg
    assert (same | near_tie).all(), f"{np.count_nonzero(~(same | near_tie))} values differ"


@pytest.mark.parametrize("n,block", [(1, 4), (7, 4), (8, 4), (9, 4), (1000, 64), (513, 512),
                                     (512, 512), (3, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_simulation(n, block, dtype):
    g = torch.Generator().manual_seed(n * 7 + block)
    x = (torch.randn(3, n, generator=g) * torch.logspace(-3, 2, n)).to(dtype)
    _compare(_roundtrip(x, block), x, block)


@pytest.mark.parametrize("segments,block", [([5, 11, 3], 4), ([8, 8, 1], 4), ([100, 1, 27], 32),
                                            ([1], 8), ([0, 6, 0, 2], 4)])
def test_segments_keep_their_edges(segments, block):
    n = sum(segments)
    g = torch.Generator().manual_seed(n)
    # a large segment next to a small one: each gets its own scale
    parts = [torch.randn(2, s, generator=g) * (100.0 if i % 2 else 0.01)
             for i, s in enumerate(segments)]
    x = torch.cat(parts, dim=1)
    got = _roundtrip(x, block, segments)
    _compare(got, x, block, segments)
    # the small segments keep a relative error of 1/254 of their own magnitude
    pos = 0
    for i, s in enumerate(segments):
        if s and i % 2 == 0:
            err = (got[:, pos:pos + s] - x[:, pos:pos + s]).abs().max()
            assert float(err) <= 0.01 * 5 / 254 * 1.001
        pos += s


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 2.0 ** -15), (torch.bfloat16, 2.0 ** -15)])
def test_error_bound_per_block(dtype, rel):
    """|x - deq| <= max|x| / 254 * (1 + 2**-15) per block (before the output dtype's rounding)."""
    block = 128
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 1000, generator=g) * torch.logspace(-4, 3, 1000)).to(dtype)
    got = _roundtrip(x, block)
    xd = x.double()
    for b in range(0, 1000, block):
        amax = xd[:, b:b + block].abs().amax(dim=1, keepdim=True)
        err = (got.double()[:, b:b + block] - xd[:, b:b + block]).abs()
        assert bool((err <= amax / 254 * (1 + rel)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_and_nonfinite_blocks(dtype):
    x = torch.zeros(2, 12)
    x[0, 5] = float("inf")
    x[1, 9] = float("nan")
    x[1, 0:4] = torch.tensor([1.0, -2.0, 0.5, 0.0])
    x[0, 10] = -float("inf")
    x = x.to(dtype)
    got = _roundtrip(x, 4)
    assert bool(torch.isnan(got[0, 4:12]).all()) and bool((got[0, :4] == 0).all())
    assert bool(torch.isnan(got[1, 8:12]).all()) and bool((got[1, 4:8] == 0).all())
    _compare(got, x, 4)


def test_wire_size_and_bad_layouts():
    assert layout(1000, 512).nbytes == 4 * 2 + 1000
    assert layout(5, 4).nbytes == 4 * 2 + 8
    assert layout(19, 4, [5, 11, 3]).nbytes == 4 * (2 + 3 + 1) + 20
    with pytest.raises(ValueError, match="sum to 18, expected the row's 19"):
        layout(19, 4, [5, 10, 3])
    with pytest.raises(ValueError, match="positive number"):
        layout(4, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_into_keeps_the_skipped_row(dtype):
    lay = layout(19, 4, [5, 11, 3])
    x = torch.randn(3, 19)
    packed = quantize_rows(x, lay)
    out = torch.full((3, 19), 7.0, dtype=dtype)
    dequantize_into(packed, lay, out, skip=1)
    assert bool((out[1] == 7.0).all())
    ref = torch.from_numpy(simulate(x.double().numpy(), 4, [5, 11, 3])).float().to(dtype)
    keep = torch.tensor([True, False, True])
    near = (out[keep].double() - ref[keep].double()).abs() <= x[keep].abs().amax() / 127 * 1.001
    assert bool(near.all()) and int((out[keep] == ref[keep]).sum()) >= 2 * 19 - 2


@pytest.mark.parametrize("factor", [1.0, 0.25])
def test_reduce_rows_sums_in_row_order(factor):
    lay = layout(37, 8, [20, 17])
    x = torch.randn(4, 37) * torch.tensor([1.0, 100.0, 0.01, 3.0]).unsqueeze(1)
    own = torch.randn(37)
    got = reduce_rows(quantize_rows(x, lay), lay, own, 2, factor)
    sim = simulate(x.double().numpy(), 8, [20, 17])
    sim[2] = own.double().numpy()
    ref = sim.sum(axis=0) * factor
    np.testing.assert_allclose(got.double().numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_bench_q8_check_counts_only_errors_past_the_bound(op):
    """bench collectives' mpicomm-pg-q8 check: a float64-simulated int8 result passes, one
    element pushed past its block's bound is counted."""
    from bench import values
    from bench.collective_peers import Q8_BLOCK, q8_wrong

    n, rank, per = 2, 1, 3 * Q8_BLOCK + 77   # a short tail block
    sl = rank * per + np.arange(per) if op == "reduce_scatter" else np.arange(per)
    parts = [values.as_float(values._pattern(s, sl, "float32"), "float32") for s in range(n)]
    sent = [p if s == rank else simulate(p[None, :], Q8_BLOCK)[0] for s, p in enumerate(parts)]
    got = (np.sum(sent, axis=0) if op == "reduce_scatter" else np.concatenate(sent))
    got = got.astype(np.float32)
    assert q8_wrong(got, op, rank, n, per, "float32") == 0
    peer = 0  # rank 0's values: the element 5 of its slice, pushed past max|x| / 254 of block 0
    bad = got.copy()
    bad[5] += np.abs(parts[peer][:Q8_BLOCK]).max() / 254 * 3
    assert q8_wrong(bad, op, rank, n, per, "float32") == 1


@pytest.mark.parametrize("aliased", [False, True])
def test_reduce_into_bf16_block_by_block(impl, aliased):
    """The numba reduce kernel on bf16 bits (FSDP2's bf16 reduce-scatter): rows summed in order
    with the own row exact, the factor applied, rounded to bf16, a NaN block kept NaN; ``out``
    may be the own row itself (it is read block by block before being written)."""
    if impl != "numba":
        pytest.skip("the numba kernel only")
    from compressed.fsdp import _numba_int8 as kernels
    lay = layout(37, 8, [20, 17])
    x = torch.randn(3, 37, generator=torch.Generator().manual_seed(4)) \
        * torch.tensor([1.0, 100.0, 0.01]).unsqueeze(1)
    x[0, 3] = float("nan")  # row 0's first block arrives as NaN
    packed = quantize_rows(x, lay)
    scale = packed[:, :4 * lay.nblocks].view(torch.float32).numpy()
    q = packed[:, 4 * lay.nblocks:4 * lay.nblocks + 37].view(torch.int8).numpy()
    own = (torch.randn(37, generator=torch.Generator().manual_seed(5)) * 50).to(torch.bfloat16)
    sim = simulate(x.double().numpy(), 8, [20, 17])
    sim[1] = own.double().numpy()
    ref = torch.from_numpy(sim.sum(axis=0) * 0.5).to(torch.bfloat16).double().numpy()
    out = own if aliased else torch.empty(37, dtype=torch.bfloat16)
    bits = own.view(torch.uint16).numpy()
    kernels.reduce_into(scale, q, lay.edges, bits, True, 1, 0.5, out.view(torch.uint16).numpy(),
                        True)
    got = out.double().numpy()
    assert np.isnan(got[:8]).all() and np.isnan(ref[:8]).all()
    np.testing.assert_allclose(got[8:], ref[8:], rtol=2 ** -7, atol=1e-6)


def test_new_wire_zeroes_only_the_send_padding():
    """A wire's send rows carry zero padding to 4 bytes (peers receive it as is); the rest is
    written by the kernels and the transfer, so a new wire need not be zero-filled."""
    from compressed.fsdp.wires import Wire
    lay = layout(37, 8, [20, 17])  # 37 values: 3 bytes of padding per row
    wire = Wire(lay, 2, 3)
    assert wire.send.shape == (2, lay.nbytes) and wire.recv.shape == (3, lay.nbytes)
    assert lay.nbytes - (4 * lay.nblocks + 37) == 3
    assert not wire.send[:, 4 * lay.nblocks + 37:].any()
    assert wire.send_q.shape == (2, 37) and wire.recv_scale.shape == (3, lay.nblocks)
