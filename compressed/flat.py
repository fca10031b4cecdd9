"""Means over ranks of many tensors at once: flattened into one fp32 buffer per device.

Used by ``ZeroOneAdam`` and ``OnebitLamb``: one exact allreduce, or one compressed allreduce
(error feedback kept by an ``OnebitAllreduce`` under the key ``<name>:<device>``), per device
and step, whatever the number of parameters.
"""
from __future__ import annotations

from typing import Any

import torch

from .errors import NonFiniteError

__all__ = ["by_device", "mean_exact", "mean_compressed"]


def by_device(tensors: list[torch.Tensor]) -> dict[str, list[int]]:
    """Indices of ``tensors`` by device, in order."""
    out: dict[str, list[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault(str(t.device), []).append(i)
    return out


def _flatten(tensors: list[torch.Tensor], idx: list[int]) -> torch.Tensor:
    return torch.cat([tensors[i].detach().reshape(-1).float() for i in idx])


def _split(flat: torch.Tensor, tensors: list[torch.Tensor], idx: list[int], out: list) -> None:
    for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
        out[i] = piece.view(tensors[i].shape)


def mean_exact(comm: Any, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 mean over ranks of each tensor (new tensors), one allreduce per device."""
    out: list[Any] = [None] * len(tensors)
    for idx in by_device(tensors).values():
        flat = _flatten(tensors, idx)
        if comm.size > 1:
            comm.all_reduce(flat, op="avg")
        _split(flat, tensors, idx, out)
    return out


def mean_compressed(onebit: Any, tensors: list[torch.Tensor], name: str) -> list[torch.Tensor]:
    """The 1-bit compressed mean over ranks of each tensor (new fp32 tensors), one compressed
    allreduce per device. A non-finite input on any rank raises ``NonFiniteError`` on every rank
    (at world size 1 too) before any error buffer changes."""
    out: list[Any] = [None] * len(tensors)
    for dev, idx in by_device(tensors).items():
        flat = _flatten(tensors, idx)
        if onebit.size == 1 and flat.numel() and not bool(torch.isfinite(flat).all()):
            raise NonFiniteError(f"{name}: the input is not finite (inf or NaN) on rank 0 of 1; "
                                 "expected finite values")
        flat = onebit.allreduce_(flat, key=f"{name}:{dev}")
        _split(flat, tensors, idx, out)
    return out
