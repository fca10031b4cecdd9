"""Plain numpy versions of the CPU kernels (the fallback when numba is absent).

Same signatures and results as ``_numba_kernels``, in a few staged whole-array passes over
scratch arrays that are kept between calls (fresh large arrays cost page faults on every call);
signs are decoded through 256-entry tables.
"""
from __future__ import annotations

import threading

import numpy as np

_BLOCK = 1 << 12  # float32 dot products this long, summed in float64 (keeps ~1e-7 accuracy)
_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(bool)  # (256, 8)
_kept = threading.local()


def _buf(tag: str, n: int, dtype) -> np.ndarray:
    """A scratch array of ``n`` elements kept (per thread) for the next call with the same tag."""
    dtype = np.dtype(dtype)
    scratch = getattr(_kept, "scratch", None)
    if scratch is None:
        scratch = _kept.scratch = {}
    arr = scratch.get((tag, dtype.str))
    if arr is None or arr.shape[0] < n:
        arr = scratch[(tag, dtype.str)] = np.empty(n, dtype)
    return arr[:n]


def _sumsq(x: np.ndarray) -> float:
    total = 0.0
    for i in range(0, x.shape[0], _BLOCK):
        blk = x[i:i + _BLOCK]
        total += float(np.dot(blk, blk))
    return total


def _x(g: np.ndarray, e: np.ndarray) -> np.ndarray:
    m = g.shape[0]
    x = _buf("x", e.shape[0], np.float32)
    np.add(g, e[:m], out=x[:m])
    x[m:] = e[m:]
    return x


def _table(scale) -> np.ndarray:
    """(256, 8) float32: +-scale for each byte value and bit position, MSB first."""
    s = np.float32(scale)
    return np.where(_BITS, s, -s)


def _pack(x: np.ndarray, out: np.ndarray) -> None:
    pos = _buf("pos", x.shape[0], bool)
    np.greater_equal(x, 0, out=pos)
    out[...] = np.packbits(pos).reshape(out.shape)


def _residual(x: np.ndarray, scale: float, out: np.ndarray) -> None:
    """out = x - scale * sign(x); ``out`` may be ``x``."""
    n = x.shape[0]
    pos = _buf("pos", n, bool)
    signed = _buf("signed", n, np.float32)
    s = np.float32(scale)
    np.greater_equal(x, 0, out=pos)
    np.multiply(pos, s + s, out=signed)  # 2s or 0, exact
    signed -= s  # +s or -s, exact
    np.subtract(x, signed, out=out)


def encode(g, e, rows):
    """Pack the signs of x = (g zero-padded) + e into ``rows`` (p, chunk_bytes); return sum x^2."""
    x = _x(g, e)
    _pack(x, rows)
    return _sumsq(x)


def _widen(gb: np.ndarray) -> np.ndarray:
    """Float32 values of bfloat16 bits (uint16): exact."""
    return (gb.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode_bf16(gb, e, rows):
    """``encode`` with g given as bfloat16 bits (uint16)."""
    return encode(_widen(gb), e, rows)


def worker_residual_bf16(gb, e, scale):
    """``worker_residual`` with g given as bfloat16 bits (uint16)."""
    worker_residual(_widen(gb), e, scale)


def encode_into(g, e, pend, xout, rows):
    """x = (g zero-padded) + (e - pend * sign(e)) into ``xout``; pack x's signs into ``rows``;
    return sum x^2."""
    m = g.shape[0]
    _residual(e, pend, xout)
    np.add(g, xout[:m], out=xout[:m])  # g + corrected error, as in the fused numba pass
    _pack(xout, rows)
    return _sumsq(xout)


def encode_mean_into(a, b, parts, e, pend, xout, rows):
    """``encode_into`` with g = (a + b) / parts (float32, rounded as ``add_mean``)."""
    g = _buf("mean", a.shape[0], np.float32)
    add_mean(a, b, parts, g)
    return encode_into(g, e, pend, xout, rows)


def worker_residual(g, e, scale):
    """Set e = x - scale * sign(x) with x = (g zero-padded) + e."""
    _residual(_x(g, e), scale, e)


def server_accumulate(rows, coef, se, out, pend):
    """Set se = sum_i coef[i] * sign_i + (se - pend * sign(se)), pack sign(se) into ``out``;
    return sum se^2."""
    n = se.shape[0]
    if pend != 0:
        _residual(se, pend, se)
    acc = _buf("acc", n, np.float32)
    tmp = _buf("signed", n, np.float32).reshape(-1, 8)
    acc[...] = 0
    for i in range(rows.shape[0]):
        np.take(_table(coef[i]), rows[i], axis=0, out=tmp)
        acc += tmp.reshape(-1)
    np.add(acc, se, out=se)
    _pack(se, out)
    return _sumsq(se)


def server_residual(se, scale):
    """Set se = se - scale * sign(se)."""
    _residual(se, scale, se)


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
        table = _table(scales[r])
        if hi - lo == chunk:
            np.take(table, rows[r], axis=0, out=out[lo:hi].reshape(cb, 8))
        else:
            out[lo:hi] = table[rows[r]].reshape(-1)[:hi - lo]


def add_mean(a: np.ndarray, b: np.ndarray, parts: int, out: np.ndarray) -> None:
    """out = (a + b) / parts in float32; ``out`` may be ``a``."""
    np.add(a, b, out=out)
    np.divide(out, np.float32(parts), out=out)
