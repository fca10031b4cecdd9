"""Symmetric int8 quantization per block (ZeRO++ qwZ style) for the weight all-gather (pure, no MPI).

A 1-D fp32 tensor is cut into blocks of ``BLOCK`` elements (the last may be shorter). Each block
gets one fp32 scale ``s = max|x| / 127`` and int8 values ``q = clamp(round(x / s), -127, 127)``
(round half to even; ``q = 0`` when ``s = 0``); ``q * s`` gives the values back. Per block the
error is at most half a step, ``|x - q*s| <= s/2 = max|x| / 254``, plus fp32 rounding of the
division and product (relative 2**-24 each), so ``<= max|x| / 254 * (1 + 2**-15)``. A block
holding inf or NaN comes back all NaN (the non-finite value is not hidden).

The wire format of ``n`` values is one uint8 row: the ``ceil(n / BLOCK)`` scales (fp32 bytes),
then the ``n`` int8 values, padded with zeros to a multiple of 4 bytes (``packed_bytes(n)``), so
the rows of all ranks all-gather as one (world, packed_bytes(n)) uint8 buffer.
"""
from __future__ import annotations

import torch

from .partition import ceil_div

#: elements per quantization block (one fp32 scale each: 0.2% overhead on the int8 bytes)
BLOCK = 2048
#: the gather_bits values ZeroOptimizer accepts (None: gather in the model's dtype)
GATHER_BITS = (None, 8)


def check_gather_bits(bits: object) -> int | None:
    """Return ``bits`` if ZeroOptimizer can gather weights at that width, else raise ValueError."""
    if bits is None or (isinstance(bits, int) and not isinstance(bits, bool) and bits == 8):
        return bits  # type: ignore[return-value]
    raise ValueError(f"ZeroOptimizer: expected gather_bits in {GATHER_BITS} (None: weights gathered in the "
                     f"model's dtype; 8: symmetric int8 per block of {BLOCK} elements), got {bits!r}")


def packed_bytes(n: int) -> int:
    """Bytes of one packed row of ``n`` values: the scales, the int8 values, padding to 4."""
    return 4 * ceil_div(n, BLOCK) + 4 * ceil_div(n, 4)


def quantize_into(x: torch.Tensor, row: torch.Tensor) -> None:
    """Quantize the 1-D fp32 tensor ``x`` into the uint8 row ``row`` (``packed_bytes(x.numel())``)."""
    n = x.numel()
    nb = ceil_div(n, BLOCK)
    if n == 0:
        return
    pad = nb * BLOCK - n
    blocks = (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(nb, BLOCK)
    amax = blocks.abs().amax(dim=1)
    amax = torch.where(torch.isnan(blocks).any(dim=1), torch.full_like(amax, float("nan")), amax)
    scale = amax / torch.full_like(amax, 127.0)     # a division on CUDA too (see compressed.fsdp.quantize)
    row[:4 * nb].view(torch.float32).copy_(scale)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(blocks / safe.unsqueeze(1)).clamp_(-127, 127).nan_to_num_(0.0)
    q_out = row[4 * nb:4 * nb + n].view(torch.int8)
    q_out.copy_(q.view(-1)[:n])
    row[4 * nb + n:].zero_()


def dequantize(rows: torch.Tensor, n: int) -> torch.Tensor:
    """The fp32 values (shape (rows, n)) of packed uint8 ``rows`` (shape (rows, packed_bytes(n)))."""
    nb = ceil_div(n, BLOCK)
    world = rows.shape[0]
    scale = rows[:, :4 * nb].reshape(-1).view(torch.float32).view(world, nb)
    q = rows[:, 4 * nb:4 * nb + n].reshape(-1).view(torch.int8).view(world, n).float()
    pad = nb * BLOCK - n
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    out = q.view(world, nb, BLOCK) * scale.unsqueeze(2)
    return out.view(world, nb * BLOCK)[:, :n]
