"""Device-generic versions of the compression steps in torch ops (used for CUDA tensors).

They enqueue work on the current stream and never read values back to the host. Bit layout as
in ``kernels``: 8 signs per byte, most significant bit first, bit 1 meaning ``x >= 0``.
"""
from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    t = _SHIFTS.get(device)
    if t is None:
        t = torch.arange(7, -1, -1, dtype=torch.uint8, device=device)
        _SHIFTS[device] = t
    return t


def pack(x: torch.Tensor) -> torch.Tensor:
    """uint8 tensor of x.numel() / 8 bytes holding the signs of ``x`` (x.numel() % 8 == 0)."""
    bits = (x >= 0).view(-1, 8).to(torch.uint8)
    return torch.bitwise_left_shift(bits, _shifts(x.device)).sum(dim=1, dtype=torch.uint8)


def signs(packed: torch.Tensor) -> torch.Tensor:
    """float32 +-1 tensor of shape packed.shape + (8,) from packed sign bytes."""
    bits = torch.bitwise_right_shift(packed.unsqueeze(-1), _shifts(packed.device)) & 1
    return bits.to(torch.float32).mul_(2.0).sub_(1.0)


def padded_sum(g: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x = (g zero-padded to e's size) + e, as a new float32 tensor."""
    x = e.clone()
    x[: g.numel()].add_(g)
    return x


def sumsq(x: torch.Tensor) -> torch.Tensor:
    """Sum of squares as a 0-d float64 tensor on x's device."""
    return torch.linalg.vector_norm(x, dtype=torch.float64).square()


def residual_(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """out = x - scale * sign(x) (sign of 0 is +1); ``out`` may be ``x``."""
    s = torch.where(x >= 0, scale, -scale)
    torch.sub(x, s, out=out)


def server_accumulate(rows: torch.Tensor, coef: torch.Tensor, se: torch.Tensor) -> None:
    """se += sum_i coef[i] * sign(rows[i]), summed over sources first."""
    p = rows.shape[0]
    acc = (signs(rows).view(p, -1) * coef.view(p, 1)).sum(dim=0)
    se.copy_(acc.add_(se))


def decode(rows: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """out = scales[r] * sign(rows[r]) for every chunk r, cut at out's length."""
    p = rows.shape[0]
    full = (signs(rows).view(p, -1) * scales.view(p, 1)).view(-1)
    out.copy_(full[: out.numel()])
