"""CPU compression kernels: numba-fused when numba is importable, plain numpy otherwise.

All arrays are numpy, float32 for values and uint8 for packed signs (8 per byte, most
significant bit first, bit 1 meaning ``x >= 0``). ``rows`` arrays are (world_size,
chunk_bytes) views whose rows may be strided (they live inside message buffers).

The implementation is picked once, on first use: ``MPICOMM_COMPRESSED_KERNELS=numba|numpy``
forces one; by default numba when it imports, numpy otherwise. ``use(name)`` switches at runtime.
"""
from __future__ import annotations

import os
from types import ModuleType

import numpy as np

__all__ = ["encode", "encode_into", "encode_mean_into", "worker_residual", "correct",
           "server_accumulate", "server_residual", "decode", "add_mean", "implementation", "use",
           "module"]

_impl: ModuleType | None = None


def _load(name: str) -> ModuleType:
    if name == "numba":
        from . import _numba_kernels as mod
        return mod
    if name == "numpy":
        from . import _numpy_kernels as mod
        return mod
    raise ValueError(f"compressed kernels: expected 'numba' or 'numpy', got {name!r}")


def use(name: str | None = None) -> str:
    """Select the kernel implementation ('numba', 'numpy', or None for the default); return it."""
    global _impl
    if name is None:
        name = os.environ.get("MPICOMM_COMPRESSED_KERNELS", "").strip().lower() or None
    if name is None:
        try:
            _impl = _load("numba")
        except ImportError:
            _impl = _load("numpy")
    else:
        _impl = _load(name)
    return implementation()


def implementation() -> str:
    """Name of the implementation in use ('numba' or 'numpy')."""
    return implementation_of(_get())


def implementation_of(mod: ModuleType) -> str:
    """Name ('numba' or 'numpy') of an implementation module from ``module``."""
    return "numba" if mod.__name__.endswith("_numba_kernels") else "numpy"


def module(name: str | None = None) -> ModuleType:
    """The implementation module for 'numba' or 'numpy' (None: the one in use), same functions
    as this module's; selecting one here changes nothing global."""
    return _get() if name is None else _load(name)


def _get() -> ModuleType:
    if _impl is None:
        use()
    assert _impl is not None
    return _impl


def encode(g: np.ndarray, e: np.ndarray, rows: np.ndarray) -> float:
    """Pack the signs of x = (g zero-padded to e's size) + e into ``rows``; return sum(x^2).

    ``g`` (m elements, m <= e.size) and ``e`` are only read.
    """
    return float(_get().encode(g, e, rows))


def encode_into(g: np.ndarray, e: np.ndarray, pending: float, xout: np.ndarray,
                rows: np.ndarray) -> float:
    """One fused pass: x = (g zero-padded) + (e - pending * sign(e)) written to ``xout`` (e's
    size; may be ``e``), x's signs packed into ``rows``; return sum(x^2).

    With ``pending`` = 0 the correction is exact identity, so x = g + e as in ``encode``.
    """
    return float(_get().encode_into(g, e, float(pending), xout, rows))


def encode_mean_into(a: np.ndarray, b: np.ndarray, parts: int, e: np.ndarray, pending: float,
                     xout: np.ndarray, rows: np.ndarray) -> float:
    """``encode_into`` with g = (a + b) / parts, computed in the same pass and rounded as
    ``add_mean`` rounds it (a hierarchical call's node mean, never written to memory)."""
    return float(_get().encode_mean_into(a, b, int(parts), e, float(pending), xout, rows))


def correct(e: np.ndarray, pending: float) -> None:
    """Set e = e - pending * sign(e) (apply a deferred error update)."""
    _get().server_residual(e, float(pending))


def worker_residual(g: np.ndarray, e: np.ndarray, scale: float) -> None:
    """Set e = x - scale * sign(x), x = (g zero-padded) + e, computed exactly as in ``encode``."""
    _get().worker_residual(g, e, float(scale))


def server_accumulate(rows: np.ndarray, coef: np.ndarray, se: np.ndarray, out: np.ndarray,
                      pending: float = 0.0) -> float:
    """Set se = sum_i coef[i] * sign(rows[i]) + (se - pending * sign(se)); pack sign(se) into
    ``out``; return sum(se^2). ``pending`` is a deferred server error update (0: none)."""
    return float(_get().server_accumulate(rows, np.ascontiguousarray(coef, np.float32), se, out,
                                          float(pending)))


def server_residual(se: np.ndarray, scale: float) -> None:
    """Set se = se - scale * sign(se)."""
    _get().server_residual(se, float(scale))


def decode(rows: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
    """Write scales[r] * sign(rows[r]) for every chunk r into ``out``, cut at out's length."""
    _get().decode(rows, np.ascontiguousarray(scales, np.float32), out)


def add_mean(a: np.ndarray, b: np.ndarray, parts: int, out: np.ndarray) -> None:
    """Set out = (a + b) / parts in float32, rounded as an add then a divide; ``out`` may be ``a``."""
    _get().add_mean(a, b, int(parts), out)
