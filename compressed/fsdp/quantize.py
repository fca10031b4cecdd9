"""Symmetric int8 quantization per block, over rows cut into segments (pure, no communication).

A row of ``n`` values is cut into segments (FSDP2: one per parameter's shard; one segment of
``n`` when none are given), each segment into blocks of ``block`` elements (the last block of a
segment may be shorter), so that no block mixes two parameters. Each block gets one fp32 scale
``s = max|x| / 127`` (computed in fp32) and int8 values ``q = clamp(round(x / s), -127, 127)``
(round half to even; ``q = 0`` when ``s = 0``); the receiver computes ``q * s`` in fp32.

Error bound per block: ``|x - q*s| <= s/2 = max|x| / 254``, plus the fp32 rounding of the
division and the product (relative ``2**-24`` each), so ``<= max|x| / 254 * (1 + 2**-15)``; the
result is then rounded once to the output dtype (bf16: half an ulp, relative ``2**-9``). A block
holding inf or NaN comes back all NaN (a non-finite value is never hidden).

Wire format of a row: the fp32 scales of all blocks, then the ``n`` int8 values, zero padding to
a multiple of 4 bytes (``packed_bytes``), so the rows of many ranks stack as one uint8 tensor.

On the CPU the fused numba kernels of ``_numba_int8`` run when numba imports (unless
``MPICOMM_COMPRESSED_KERNELS=numpy``); elsewhere (CUDA) the torch twins here, on the device.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from ..kernels import ENV

__all__ = ["Layout", "layout", "packed_bytes", "quantize_rows", "dequantize_rows",
           "dequantize_into", "reduce_rows"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Layout:
    """Where the blocks of a row of ``n`` values lie (``block`` elements, segment edges kept)."""

    n: int
    block: int
    segments: tuple[int, ...]
    nblocks: int
    # padded position -> source position (n: a zero); None when no padding inside the row
    gather: torch.Tensor | None = field(repr=False, compare=False)
    # row position -> padded position; None as above
    scatter: torch.Tensor | None = field(repr=False, compare=False)
    # block edges as element offsets in the row (nblocks + 1)
    edges: np.ndarray = field(repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return packed_bytes(self.n, self.nblocks)


def packed_bytes(n: int, nblocks: int) -> int:
    """Bytes of one packed row: ``nblocks`` fp32 scales, ``n`` int8 values, padding to 4."""
    return 4 * nblocks + 4 * _ceil_div(n, 4)


@lru_cache(maxsize=256)
def _layout(n: int, block: int, segments: tuple[int, ...]) -> Layout:
    edges, pos = [0], 0
    for s in segments:
        edges.extend(min(pos + k, pos + s) for k in range(block, s + block, block))
        pos += s
    edges = np.asarray(edges, dtype=np.uint64)  # unsigned: numba indexes without wraparound
    if len(segments) <= 1 or all(s % block == 0 for s in segments[:-1]):
        # blocks of the whole row already respect the segment edges: only the row's tail is short
        return Layout(n, block, segments, _ceil_div(n, block), None, None, edges)
    starts, pos = [], 0
    nblocks = 0
    for s in segments:
        starts.append((pos, nblocks))
        nblocks += _ceil_div(s, block)
        pos += s
    gather = torch.full((nblocks * block,), n, dtype=torch.int64)
    scatter = torch.empty(n, dtype=torch.int64)
    for (src, blk), s in zip(starts, segments):
        dst = blk * block
        gather[dst:dst + s] = torch.arange(src, src + s)
        scatter[src:src + s] = torch.arange(dst, dst + s)
    return Layout(n, block, segments, nblocks, gather, scatter, edges)


def layout(n: int, block: int, segments: Sequence[int] | None = None) -> Layout:
    """The block layout of rows of ``n`` values; ``segments`` (summing to ``n``) keep their
    edges."""
    if block < 1:
        raise ValueError(f"quantization block: expected a positive number of elements, got {block}")
    segs = tuple(int(s) for s in segments) if segments else (n,)
    segs = tuple(s for s in segs if s) or (n,)
    if sum(segs) != n:
        raise ValueError(f"quantization layout: segments {list(segs)} sum to {sum(segs)}, "
                         f"expected the row's {n} elements")
    return _layout(n, block, segs)


def _blocks(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    """(rows, nblocks, block) fp32 view of ``x`` (rows, n), zeros where blocks are padded."""
    rows = x.shape[0]
    x = x.float()
    if lay.gather is not None:
        padded = torch.cat([x, x.new_zeros(rows, 1)], dim=1)
        return padded[:, lay.gather.to(x.device)].view(rows, lay.nblocks, lay.block)
    pad = lay.nblocks * lay.block - lay.n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(rows, lay.nblocks, lay.block)


_NUMBA: list = []  # [the numba kernel module, or None when numba does not import], once


def _numba(t: torch.Tensor):
    """The numba kernels for a CPU tensor, or None (CUDA, no numba, or forced off)."""
    if not t.is_cpu or os.environ.get(ENV, "").strip().lower() == "numpy":
        return None
    if not _NUMBA:
        try:
            from . import _numba_int8 as kernels
        except ImportError:
            kernels = None
        _NUMBA.append(kernels)
    return _NUMBA[0]


def _split(packed: torch.Tensor, lay: Layout):
    """(scales (rows, nblocks) fp32, values (rows, n) int8) views of packed rows."""
    start = 4 * lay.nblocks
    return packed[:, :start].view(torch.float32), packed[:, start:start + lay.n].view(torch.int8)


def quantize_rows(x: torch.Tensor, lay: Layout, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack each row of ``x`` (rows, n; any float dtype) into uint8 rows (rows, lay.nbytes)."""
    rows = x.shape[0]
    if out is None:
        out = torch.empty(rows, lay.nbytes, dtype=torch.uint8, device=x.device)
    if lay.n == 0:
        return out
    nb = _numba(x)
    if nb is not None:
        scale, q = _split(out, lay)
        if x.dtype == torch.bfloat16 and x.is_contiguous():
            nb.quantize_bf16(x.view(torch.uint16).numpy(), lay.edges, scale.numpy(), q.numpy(), -1)
        else:
            nb.quantize(x.float().contiguous().numpy(), lay.edges, scale.numpy(), q.numpy(), -1)
        out[:, 4 * lay.nblocks + lay.n:].zero_()
        return out
    blocks = _blocks(x, lay)
    amax = blocks.abs().amax(dim=2)
    bad = ~torch.isfinite(blocks).all(dim=2)
    # a tensor divisor: torch divides by a Python number on CUDA as a product with its
    # reciprocal, one ulp off the division the CPU kernels and the simulation make
    scale = torch.where(bad, torch.full_like(amax, float("nan")), amax / torch.full_like(amax, 127.0))
    out[:, :4 * lay.nblocks].view(torch.float32).copy_(scale)
    safe = torch.where((scale == 0) | bad, torch.ones_like(scale), scale)
    q = torch.round(blocks / safe.unsqueeze(2)).clamp_(-127, 127).nan_to_num_(0.0)
    q = q.view(rows, -1)
    if lay.scatter is not None:
        q = q[:, lay.scatter.to(x.device)]
    elif q.shape[1] != lay.n:
        q = q[:, :lay.n]
    start = 4 * lay.nblocks
    out[:, start:start + lay.n].view(torch.int8).copy_(q)
    out[:, start + lay.n:].zero_()
    return out


def dequantize_into(packed: torch.Tensor, lay: Layout, out: torch.Tensor, skip: int = -1) -> None:
    """Write the values of packed rows into ``out`` (rows, n; any float dtype), but row ``skip``."""
    nb = _numba(packed)
    if nb is not None and out.dtype in (torch.float32, torch.bfloat16):
        scale, q = _split(packed, lay)
        if out.dtype == torch.float32:
            nb.dequantize(scale.numpy(), q.numpy(), lay.edges, out.numpy(), skip)
        else:
            nb.dequantize_bf16(scale.numpy(), q.numpy(), lay.edges,
                               out.view(torch.uint16).numpy(), skip)
        return
    if nb is not None:
        values = torch.empty(out.shape, dtype=torch.float32)
        scale, q = _split(packed, lay)
        nb.dequantize(scale.numpy(), q.numpy(), lay.edges, values.numpy(), skip)
    else:
        values = dequantize_rows(packed, lay)
    if 0 <= skip < out.shape[0]:
        kept = out[skip].clone()
        out.copy_(values)
        out[skip].copy_(kept)
    else:
        out.copy_(values)


def reduce_rows(packed: torch.Tensor, lay: Layout, own: torch.Tensor, rank: int,
                factor: float) -> torch.Tensor:
    """fp32 ``factor * sum`` over the packed rows in row order, row ``rank`` replaced by ``own``
    (exact), as a new (n,) tensor."""
    nb = _numba(packed)
    if nb is not None:
        total = torch.empty(lay.n, dtype=torch.float32)
        scale, q = _split(packed, lay)
        nb.reduce_into(scale.numpy(), q.numpy(), lay.edges, own.float().numpy(), False, rank,
                       float(factor), total.numpy(), False)
        return total
    values = dequantize_rows(packed, lay)
    total = torch.zeros(lay.n, dtype=torch.float32, device=packed.device)
    for r in range(packed.shape[0]):
        total += own.float() if r == rank else values[r]
    return total * factor if factor != 1.0 else total


def dequantize_rows(packed: torch.Tensor, lay: Layout) -> torch.Tensor:
    """The fp32 values (rows, n) of uint8 rows (rows, lay.nbytes) packed by ``quantize_rows``."""
    rows = packed.shape[0]
    nb, start = lay.nblocks, 4 * lay.nblocks
    scale = packed[:, :start].view(torch.float32)
    q = packed[:, start:start + lay.n].view(torch.int8)
    if lay.gather is not None:
        # the block of every element: scale per element, then one product
        owner = (lay.scatter // lay.block).to(packed.device)
        return q.float() * scale[:, owner]
    pad = nb * lay.block - lay.n
    qf = q.float()
    if pad:
        qf = torch.nn.functional.pad(qf, (0, pad))
    out = qf.view(rows, nb, lay.block) * scale.unsqueeze(2)
    return out.view(rows, nb * lay.block)[:, :lay.n]
