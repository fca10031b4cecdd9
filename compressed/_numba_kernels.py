"""Fused single-thread CPU kernels compiled with numba (imported only when numba is present).

Every function here has a numpy twin with the same signature in ``_numpy_kernels``. Signs are
packed 8 per byte, most significant bit first; bit 1 means ``x >= 0`` (zero counts as +1).
"""
from __future__ import annotations

import numba
import numpy as np

_jit = numba.njit(cache=True, nogil=True)


@_jit
def encode(g, e, rows):
    """Pack the signs of x = (g zero-padded) + e into ``rows`` (p, chunk_bytes); return sum x^2."""
    m = g.shape[0]
    p, cb = rows.shape
    ss = 0.0
    for r in range(p):
        for c in range(cb):
            base = (r * cb + c) * 8
            byte = 0
            part = np.float32(0.0)
            if base + 8 <= m:
                for k in range(8):
                    x = g[base + k] + e[base + k]
                    part += x * x
                    byte = (byte << 1) | (1 if x >= 0 else 0)
            else:
                for k in range(8):
                    i = base + k
                    x = e[i] + g[i] if i < m else e[i]
                    part += x * x
                    byte = (byte << 1) | (1 if x >= 0 else 0)
            rows[r, c] = byte
            ss += part
    return ss


@_jit
def worker_residual(g, e, scale):
    """Set e = x - scale * sign(x) with x = (g zero-padded) + e."""
    m = g.shape[0]
    s = np.float32(scale)
    for i in range(m):
        x = g[i] + e[i]
        e[i] = x - s if x >= 0 else x + s
    for i in range(m, e.shape[0]):
        x = e[i]
        e[i] = x - s if x >= 0 else x + s


@_jit
def _luts(scales):
    """One 256 x 8 table of +-scale per byte value and bit position (MSB first) per scale."""
    n = scales.shape[0]
    lut = np.empty((n, 256, 8), np.float32)
    for i in range(n):
        s = scales[i]
        for v in range(256):
            for k in range(8):
                lut[i, v, k] = s if (v >> (7 - k)) & 1 else -s
    return lut


@_jit
def server_accumulate(rows, coef, se, out):
    """Set se = sum_i coef[i] * sign_i + se, pack sign(se) into ``out``; return sum se^2."""
    p, cb = rows.shape
    lut = _luts(coef)
    acc = np.empty(8, np.float32)
    ss = 0.0
    for c in range(cb):
        for k in range(8):
            acc[k] = 0.0
        for i in range(p):
            v = rows[i, c]
            for k in range(8):
                acc[k] += lut[i, v, k]
        byte = 0
        part = np.float32(0.0)
        base = c * 8
        for k in range(8):
            s = acc[k] + se[base + k]
            se[base + k] = s
            part += s * s
            byte = (byte << 1) | (1 if s >= 0 else 0)
        out[c] = byte
        ss += part
    return ss


@_jit
def server_residual(se, scale):
    """Set se = se - scale * sign(se)."""
    s = np.float32(scale)
    for i in range(se.shape[0]):
        x = se[i]
        se[i] = x - s if x >= 0 else x + s


@_jit
def decode(rows, scales, out):
    """Write scales[r] * sign (from row r's bits) into ``out``, cut at out's length."""
    m = out.shape[0]
    p, cb = rows.shape
    lut = _luts(scales)
    for r in range(p):
        for c in range(cb):
            base = (r * cb + c) * 8
            v = rows[r, c]
            if base + 8 <= m:
                for k in range(8):
                    out[base + k] = lut[r, v, k]
            else:
                for k in range(8):
                    if base + k < m:
                        out[base + k] = lut[r, v, k]
                return
