"""Plain numpy versions of the CPU kernels (the fallback when numba is absent).

Same signatures and results as ``_numba_kernels``; a few staged passes over preallocated
scratch space instead of one fused loop.
"""
from __future__ import annotations

import numpy as np

_BLOCK = 1 << 16  # elements per float32 dot product before accumulating in float64


def _sumsq(x: np.ndarray) -> float:
    total = 0.0
    for i in range(0, x.shape[0], _BLOCK):
        blk = x[i:i + _BLOCK]
        total += float(np.dot(blk, blk))
    return total


def _x(g: np.ndarray, e: np.ndarray) -> np.ndarray:
    m = g.shape[0]
    x = np.empty_like(e)
    np.add(g, e[:m], out=x[:m])
    x[m:] = e[m:]
    return x


def _pack_into(x: np.ndarray, out: np.ndarray) -> None:
    out[...] = np.packbits(x >= 0).reshape(out.shape)


def _residual(x: np.ndarray, scale: float, out: np.ndarray) -> None:
    s = np.float32(scale)
    pos = x >= 0
    np.subtract(x, s, out=out, where=pos)
    np.add(x, s, out=out, where=~pos)


def encode(g, e, rows):
    """Pack the signs of x = (g zero-padded) + e into ``rows`` (p, chunk_bytes); return sum x^2."""
    x = _x(g, e)
    _pack_into(x, rows)
    return _sumsq(x)


def worker_residual(g, e, scale):
    """Set e = x - scale * sign(x) with x = (g zero-padded) + e."""
    _residual(_x(g, e), scale, e)


def _signs(rows: np.ndarray) -> np.ndarray:
    """+-1 float32 array (p, chunk_bytes * 8) from packed rows."""
    bits = np.unpackbits(rows, axis=1)
    return bits.astype(np.float32) * np.float32(2.0) - np.float32(1.0)


def server_accumulate(rows, coef, se, out):
    """Set se = sum_i coef[i] * sign_i + se, pack sign(se) into ``out``; return sum se^2."""
    acc = np.zeros_like(se)
    for i in range(rows.shape[0]):
        acc += _signs(rows[i:i + 1])[0] * np.float32(coef[i])
    np.add(acc, se, out=se)
    _pack_into(se, out)
    return _sumsq(se)


def server_residual(se, scale):
    """Set se = se - scale * sign(se)."""
    _residual(se.copy(), scale, se)


def decode(rows, scales, out):
    """Write scales[r] * sign (from row r's bits) into ``out``, cut at out's length."""
    m = out.shape[0]
    p, cb = rows.shape
    chunk = cb * 8
    for r in range(p):
        lo = r * chunk
        if lo >= m:
            break
        hi = min(m, lo + chunk)
        signs = _signs(rows[r:r + 1])[0, :hi - lo]
        np.multiply(signs, np.float32(scales[r]), out=out[lo:hi])
