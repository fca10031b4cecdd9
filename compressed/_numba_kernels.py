"""Fused single-thread CPU kernels compiled with numba (imported only when numba is present).

Every function here has a numpy twin with the same signature in ``_numpy_kernels``. Signs are
packed 8 per byte, most significant bit first; bit 1 means ``x >= 0`` (zero counts as +1).
Measured choices (64 MiB, one core, CPU time): encode in 4096-element tiles (a vectorised pass
writing 0/1 flag bytes into L1, then 8 flags packed per multiply, into a contiguous buffer) took
9.7 ms against 15 ms storing into the strided message rows, 12.2 ms for flags in memory +
numpy.packbits and 13.4 ms for 64-element groups, with memcpy at 9.4 ms; a fused
residual+decode pass was slower than the two separate passes. The streaming stores and the
fence after them are ``_numba_intrinsics``'.
"""
from __future__ import annotations

import threading

import numba
import numpy as np
from numba.extending import overload

from ._numba_intrinsics import can_stream as _can_stream
from ._numba_intrinsics import nt_copy8 as _nt_copy8
from ._numba_intrinsics import nt_store as _nt_store
from ._numba_intrinsics import sfence as _sfence

_jit = numba.njit(cache=True, nogil=True)

# Loops that build signs and sums work on blocks of elements: x, the sum of squares (float32
# within a block, reassociated so it vectorises; float64 across blocks) and one 0/1 flag byte
# per element vectorise; a multiply gathers 8 flag bytes into one MSB-first byte.
_MAGIC = np.uint64(0x8040201008040201)
_jitv = numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})

_TILE = 4096  # elements per tile: flags stay in L1, float32 partial sums stay accurate


_inline = numba.njit(inline="always")  # a loop body shared by kernels, inlined into each


@_inline
def _shrink(v, s):
    """v - s * sign(v) (sign(0) = +1): what error feedback keeps of v once s * sign(v) is sent."""
    return v - (s if v >= np.float32(0.0) else -s)


@_inline
def _pack_flags(words, packed, b0, nq):
    """packed[b0:b0 + nq] = the 0/1 flag bytes seen as ``nq`` uint64 ``words``, 8 per byte."""
    for q in range(nq):
        packed[b0 + q] = np.uint8((words[q] * _MAGIC) >> np.uint64(56))


@_inline
def _signs_tile(gt, et, flags):
    """x = gt + et over a tile: its sign flags; return sum x^2 (float32, vectorised)."""
    part = np.float32(0.0)
    for k in range(_TILE):
        x = gt[k] + et[k]
        part += x * x
        flags[k] = x >= np.float32(0.0)
    return part


@_jit
def _signs_tail(x, packed, c0, ss):
    """Pack the signs of ``x`` (a multiple of 8 long) into packed[c0:]; return ss + sum x^2
    (added one element at a time, in order)."""
    for c in range(x.shape[0] // 8):
        byte = 0
        for k in range(8):
            v = x[c * 8 + k]
            ss += v * v
            byte = (byte << 1) | (1 if v >= 0 else 0)
        packed[c0 + c] = byte
    return ss


@_jitv
def _encode_flat(g, e, packed):
    """Pack the signs of x = (g zero-padded) + e into contiguous ``packed``; return sum x^2."""
    m = g.shape[0]
    n = e.shape[0]
    flags = np.empty(_TILE, np.uint8)
    words = flags.view(np.uint64)
    full = m - m % _TILE
    ss = 0.0
    for o in range(0, full, _TILE):  # x, x^2 and one 0/1 byte per element, then 8 bytes -> 1
        ss += _signs_tile(g[o:o + _TILE], e[o:o + _TILE], flags)
        _pack_flags(words, packed, o // 8, _TILE // 8)
    tail = e[full:n].copy()
    for i in range(full, m):
        tail[i - full] = e[i] + g[i]
    return _signs_tail(tail, packed, full // 8, ss)


@_jitv
def _encode_bf16_flat(gb, e, packed):
    """``_encode_flat`` with g given as bfloat16 bits (uint16), widened to float32 (exact) in a
    tile buffer: a bf16 gradient never goes through a float32 copy in memory."""
    m = gb.shape[0]
    n = e.shape[0]
    flags = np.empty(_TILE, np.uint8)
    words = flags.view(np.uint64)
    wide = np.empty(_TILE, np.uint32)
    full = m - m % _TILE
    ss = 0.0
    for o in range(0, full, _TILE):
        for k in range(_TILE):  # vectorised: bf16 bits -> float32 bits
            wide[k] = np.uint32(gb[o + k]) << np.uint32(16)
        ss += _signs_tile(wide.view(np.float32), e[o:o + _TILE], flags)
        _pack_flags(words, packed, o // 8, _TILE // 8)
    tail = e[full:n].copy()
    for i in range(full, m):
        wide[0] = np.uint32(gb[i]) << np.uint32(16)
        tail[i - full] = e[i] + wide.view(np.float32)[0]
    return _signs_tail(tail, packed, full // 8, ss)


def _g(src, i, d):
    """Element i of the gradient: src[0][i] when ``src`` is (g,), (a[i] + b[i]) / d when it is
    (a, b) (the node mean, rounded as ``add_mean``); numba picks one when it compiles."""


@overload(_g, inline="always")
def _g_numba(src, i, d):
    if len(src) == 1:
        return lambda src, i, d: src[0][i]
    return lambda src, i, d: (src[0][i] + src[1][i]) / d


@_jitv
def _encode_into_flat(src, parts, e, pend, xout, packed, stream):
    """x = (g zero-padded) + (e - pend * sign(e)) into ``xout`` (may be ``e``), g given by
    ``src``: (g,), or (a, b) for g = (a + b) / parts computed on the fly (the node mean of a
    hierarchical call never goes through memory); pack x's signs into contiguous ``packed``;
    return sum x^2. One pass: the previous call's error update fused with this call's encode.
    ``stream``: store whole tiles of x with non-temporal stores. Compiled once per kind of
    ``src`` (a runtime flag for the mean ran 20% slower, 64 MiB, one core)."""
    m = src[0].shape[0]
    n = e.shape[0]
    s = np.float32(pend)
    d = np.float32(parts)
    flags = np.empty(_TILE, np.uint8)
    words = flags.view(np.uint64)
    full = m - m % _TILE
    ss = 0.0
    for o in range(0, full, _TILE):
        et = e[o:o + _TILE]
        xt = xout[o:o + _TILE]
        part = np.float32(0.0)
        for k in range(_TILE):  # vectorised: g, correction, x, x^2, one 0/1 byte per element
            x = _g(src, o + k, d) + _shrink(et[k], s)
            if stream:
                _nt_store(xt, k, x)
            else:
                xt[k] = x
            part += x * x
            flags[k] = x >= np.float32(0.0)
        ss += part
        _pack_flags(words, packed, o // 8, _TILE // 8)
    for i in range(full, n):
        corr = _shrink(e[i], s)
        xout[i] = _g(src, i, d) + corr if i < m else corr
    if stream:
        _sfence()
    return _signs_tail(xout[full:n], packed, full // 8, ss)


@_jit
def _add_mean_flat(a, b, parts, out, stream):
    """out = (a + b) / parts in float32, one pass; ``stream``: whole tiles of ``out`` with
    non-temporal stores (``out`` may be ``a``: each element is read before it is written)."""
    n = out.shape[0]
    d = np.float32(parts)
    full = n - n % _TILE if stream else 0
    for o in range(0, full, _TILE):
        at = a[o:o + _TILE]
        bt = b[o:o + _TILE]
        ot = out[o:o + _TILE]
        for k in range(_TILE):
            _nt_store(ot, k, (at[k] + bt[k]) / d)
    for i in range(full, n):
        out[i] = (a[i] + b[i]) / d
    if stream:
        _sfence()


def add_mean(a, b, parts, out):
    """out = (a + b) / parts (float32, rounded as numpy's add then divide); ``out`` may be ``a``.
    One pass with streaming stores: rows of 32 MiB, four ranks on two cores (netsim, 2 hosts x 2
    ranks), 7.4-8.1 ms per call against 12.3-15.0 ms for numpy's add and divide."""
    stream = _can_stream(out)
    _add_mean_flat(a, b, parts, out, stream)


_kept = threading.local()  # packed scratch kept between calls (fresh arrays cost page faults)


def _packed_scratch(nbytes):
    packed = getattr(_kept, "packed", None)
    if packed is None or packed.shape[0] < nbytes:
        packed = _kept.packed = np.empty(nbytes, np.uint8)
    return packed[:nbytes]


def encode(g, e, rows):
    """Pack the signs of x = (g zero-padded) + e into ``rows`` (p, chunk_bytes); return sum x^2."""
    packed = _packed_scratch(e.shape[0] // 8)
    ss = _encode_flat(g, e, packed)
    rows[...] = packed.reshape(rows.shape)  # strided rows: storing there directly was slower
    return ss


def encode_bf16(gb, e, rows):
    """``encode`` with g given as bfloat16 bits (uint16)."""
    packed = _packed_scratch(e.shape[0] // 8)
    ss = _encode_bf16_flat(gb, e, packed)
    rows[...] = packed.reshape(rows.shape)
    return ss


def encode_into(g, e, pend, xout, rows):
    """x = (g zero-padded) + (e - pend * sign(e)) into ``xout``; pack x's signs into ``rows``;
    return sum x^2."""
    packed = _packed_scratch(e.shape[0] // 8)
    stream = _can_stream(xout)
    ss = _encode_into_flat((g,), 1, e, pend, xout, packed, stream)
    rows[...] = packed.reshape(rows.shape)
    return ss


def encode_mean_into(a, b, parts, e, pend, xout, rows):
    """``encode_into`` with g = (a + b) / parts (float32, rounded as ``add_mean``)."""
    packed = _packed_scratch(e.shape[0] // 8)
    stream = _can_stream(xout)
    ss = _encode_into_flat((a, b), parts, e, pend, xout, packed, stream)
    rows[...] = packed.reshape(rows.shape)
    return ss


@_jit
def worker_residual(g, e, scale):
    """Set e = x - scale * sign(x) with x = (g zero-padded) + e."""
    m = g.shape[0]
    s = np.float32(scale)
    for i in range(m):
        e[i] = _shrink(g[i] + e[i], s)
    for i in range(m, e.shape[0]):
        e[i] = _shrink(e[i], s)


@_jitv
def worker_residual_bf16(gb, e, scale):
    """``worker_residual`` with g given as bfloat16 bits (uint16)."""
    m = gb.shape[0]
    s = np.float32(scale)
    wide = np.empty(_TILE, np.uint32)
    gw = wide.view(np.float32)
    full = m - m % _TILE
    for o in range(0, full, _TILE):
        et = e[o:o + _TILE]
        for k in range(_TILE):  # vectorised: bf16 bits -> float32 bits
            wide[k] = np.uint32(gb[o + k]) << np.uint32(16)
        for k in range(_TILE):
            et[k] = _shrink(gw[k] + et[k], s)
    for i in range(full, e.shape[0]):
        if i < m:
            wide[0] = np.uint32(gb[i]) << np.uint32(16)
            e[i] = _shrink(e[i] + gw[0], s)
        else:
            e[i] = _shrink(e[i], s)


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
def _expand_lut():
    """uint64 per byte value whose 8 bytes are its bits (0 or 1), MSB first in memory order."""
    lut = np.empty(256, np.uint64)
    for v in range(256):
        w = np.uint64(0)
        for k in range(8):
            if (v >> (7 - k)) & 1:
                w |= np.uint64(1) << np.uint64(8 * k)
        lut[v] = w
    return lut


#: Elements per block of ``server_accumulate``: 256 vectorised well (64 MiB, 2 rows: 3.7 ms
#: against 6.5 ms for 64-element blocks and 3.4-3.9 ms for a 32 MiB memcpy; 128: 4.1, 512: 3.9).
_SBLK = 256


@_jitv
def server_accumulate(rows, coef, se, out, pend):
    """Set se = sum_i coef[i] * sign_i + (se - pend * sign(se)), pack sign(se) into ``out``;
    return sum se^2."""
    p, cb = rows.shape
    sp = np.float32(pend)
    expand = _expand_lut()
    flags = np.empty(_SBLK, np.uint8)
    words = flags.view(np.uint64)
    acc = np.empty(_SBLK, np.float32)
    two = np.empty(p, np.float32)
    base = np.float32(0.0)
    for i in range(p):
        two[i] = np.float32(2.0) * coef[i]
        base -= coef[i]
    ss = 0.0
    qb = _SBLK // 8  # packed bytes per block
    nblk = cb // qb
    for blk in range(nblk):
        for k in range(_SBLK):
            acc[k] = base
        for i in range(p):  # sign * c = 2c * bit - c
            for q in range(qb):
                words[q] = expand[rows[i, blk * qb + q]]
            c2 = two[i]
            for k in range(_SBLK):
                acc[k] += c2 * flags[k]
        o = blk * _SBLK
        part = np.float32(0.0)
        for k in range(_SBLK):
            s = acc[k] + _shrink(se[o + k], sp)
            se[o + k] = s
            part += s * s
            flags[k] = s >= np.float32(0.0)
        ss += part
        _pack_flags(words, out, blk * qb, qb)
    for c in range(nblk * qb, cb):
        byte = 0
        for k in range(8):
            s = np.float32(0.0)
            for i in range(p):
                s += coef[i] if (rows[i, c] >> (7 - k)) & 1 else -coef[i]
            s += _shrink(se[c * 8 + k], sp)
            se[c * 8 + k] = s
            ss += s * s
            byte = (byte << 1) | (1 if s >= 0 else 0)
        out[c] = byte
    return ss


@_jit
def server_residual(se, scale):
    """Set se = se - scale * sign(se)."""
    s = np.float32(scale)
    for i in range(se.shape[0]):
        se[i] = _shrink(se[i], s)


@_jit
def _decode_flat(rows, scales, out, stream):
    """Write scales[r] * sign (from row r's bits) into ``out``, cut at out's length;
    ``stream``: each whole byte's 8 values with non-temporal stores (the output is not read
    again in this call, and a plain store first reads each line it writes: 64 MiB, 8.2 ms ->
    3.4 ms, memcpy 9.4 ms)."""
    m = out.shape[0]
    p, cb = rows.shape
    lut = _luts(scales)
    for r in range(p):
        for c in range(cb):
            base = (r * cb + c) * 8
            v = rows[r, c]
            if base + 8 > m:  # past out's end: the values that still fit
                for k in range(8):
                    if base + k < m:
                        out[base + k] = lut[r, v, k]
            elif stream:
                _nt_copy8(lut, r, np.intp(v), out, base)
            else:
                for k in range(8):
                    out[base + k] = lut[r, v, k]
    if stream:
        _sfence()


def decode(rows, scales, out):
    """Write scales[r] * sign (from row r's bits) into ``out``, cut at out's length."""
    _decode_flat(rows, scales, out, _can_stream(out, 16))
