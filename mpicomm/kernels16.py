"""The combine step of 16-bit reductions: p rows of bfloat16/float16 into one row, rounded once.

``reduce_rows`` sums (or takes the max/min of) the rows element by element in float32, in row
order (row 0 first, so every rank that reduces the same rows gets the same bits), applies the
AVG divisor or the PREMUL_SUM factor in float32, and rounds the result once to 16 bits.
MAX/MIN are exact. Host rows go through a fused numba kernel when numba is installed (one
pass, about as fast as a copy); otherwise, and for device tensors, through torch
(``reduce_rows_torch``, same results). ``MPICOMM_REDUCE16_KERNELS=numba|torch`` forces one.
"""
from __future__ import annotations

import os

import numpy as np
import torch

SUM, MAX, MIN = 0, 1, 2           # combine kinds
PLAIN, DIVIDE, MULTIPLY = 0, 1, 2  # what happens to a sum before rounding

_numba = None  # the numba kernel (``_kernels16_numba.reduce_rows``) once chosen
_choice: str | None = None


def implementation() -> str:
    """'numba' or 'torch': the kernel host rows go through."""
    global _numba, _choice
    if _choice is None:
        wanted = os.environ.get("MPICOMM_REDUCE16_KERNELS", "").strip().lower() or None
        if wanted not in (None, "numba", "torch"):
            raise ValueError(f"MPICOMM_REDUCE16_KERNELS: expected 'numba' or 'torch', got {wanted!r}")
        if wanted != "torch":
            try:
                from ._kernels16_numba import reduce_rows as kernel
                _numba = kernel
            except ImportError:
                if wanted == "numba":
                    raise
        _choice = "numba" if _numba is not None else "torch"
    return _choice


def as_bits(t: torch.Tensor) -> np.ndarray:
    """A host 16-bit tensor's bit patterns as a numpy uint16 array (shares memory)."""
    return t.view(torch.int16).numpy().view(np.uint16)


def reduce_rows(rows: np.ndarray, own: np.ndarray | None, me: int, out: np.ndarray, dtype: str,
                kind: int, mode: int = PLAIN, scale: float = 1.0) -> None:
    """out = combine(rows) rounded once; row ``me`` is read from ``own`` (when not None).

    ``rows`` is a [p, m] uint16 array of bit patterns, ``out`` and ``own`` uint16[m] (``out``
    may be ``own``); ``dtype`` is "bfloat16" or "float16"; ``kind`` SUM, MAX or MIN; ``mode``
    DIVIDE or MULTIPLY applies ``scale`` to a sum in float32.
    """
    if implementation() == "numba":
        _numba(rows, rows[0] if own is None else own, -1 if own is None else me, out, mode,
               scale, kind, dtype == "bfloat16")
        return
    bits = (lambda a: torch.from_numpy(a.view(np.int16)))
    reduce_rows_bits(bits(rows), None if own is None else bits(own), me, bits(out), dtype, kind, mode, scale)


def reduce_rows_bits(rows: torch.Tensor, own: torch.Tensor | None, me: int, out: torch.Tensor, dtype: str,
                     kind: int, mode: int = PLAIN, scale: float = 1.0) -> None:
    """``reduce_rows`` over int16 torch tensors of bit patterns, on their device (torch kernels)."""
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    parts = [(own if own is not None and r == me else rows[r]).view(tdt) for r in range(rows.shape[0])]
    reduce_rows_torch(parts, out.view(tdt), kind, mode, scale)


def reduce_rows_torch(parts: list, out: torch.Tensor, kind: int, mode: int = PLAIN,
                      scale: float = 1.0) -> None:
    """``reduce_rows`` on torch tensors (any device): ``parts`` in row order, ``out`` 16-bit."""
    acc = parts[0].to(torch.float32, copy=True)
    for part in parts[1:]:
        if kind == SUM:
            acc.add_(part)
        elif kind == MAX:
            torch.maximum(acc, part.to(torch.float32), out=acc)
        else:
            torch.minimum(acc, part.to(torch.float32), out=acc)
    if mode == DIVIDE:
        torch.div(acc, torch.tensor(scale, dtype=torch.float32, device=acc.device), out=acc)
    elif mode == MULTIPLY:
        torch.mul(acc, torch.tensor(scale, dtype=torch.float32, device=acc.device), out=acc)
    out.copy_(acc)
