"""Fused numba kernels for 16-bit reductions (imported only when numba is present).

Each kernel reads ``rows`` (p rows of one block, the 16-bit bit patterns as uint16), combines
them element by element in float32 in row order (row 0 first), applies the scale and writes
one 16-bit result, rounded once to nearest-even: one pass over the inputs, one store. Same
results, bit for bit, as ``kernels16.reduce_rows_torch`` (torch's float32 arithmetic and
conversions; a NaN stays a NaN, its payload bits may differ).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_jit = numba.njit(cache=True, nogil=True)
_TILE = 1024  # elements per tile: the float32 accumulator stays in L1


@intrinsic
def _h2f(typingctx, bits):  # noqa: ARG001
    """float16 bit pattern (uint16) -> float32 (LLVM fpext: exact, vectorises to vcvtph2ps)."""
    def codegen(context, builder, sig, args):
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def _f2h(typingctx, value):  # noqa: ARG001
    """float32 -> float16 bit pattern (LLVM fptrunc: IEEE round to nearest even)."""
    def codegen(context, builder, sig, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(half, ir.IntType(16))
    return types.uint16(value), codegen


@intrinsic
def _bf2f(typingctx, bits):  # noqa: ARG001
    """bfloat16 bit pattern (uint16) -> float32 (exact: the bits in the upper half)."""
    def codegen(context, builder, sig, args):
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def _f2bits(typingctx, value):  # noqa: ARG001
    """float32 -> its uint32 bit pattern."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(value), codegen


@_jit
def _f2bf(x):
    """float32 -> bfloat16 bits, round to nearest even; NaN -> 0x7FC0 (c10's scalar rule)."""
    u = _f2bits(x)
    rounded = np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))))
                        >> np.uint32(16))
    return np.uint16(0x7FC0) if x != x else rounded




@_jit
def sum_bf16(rows, own, me, out, mode, scale):
    """out = the sum (mode 1: divided by scale, 2: times scale) of the rows, in float32 in row order, rounded once."""
    p, m = rows.shape
    s = np.float32(scale)
    tile = np.empty(_TILE, np.float32)
    for o in range(0, m, _TILE):
        t = min(_TILE, m - o)
        acc = tile[:t]
        first = own[o:o + t] if me == 0 else rows[0, o:o + t]
        for k in range(t):
            acc[k] = _bf2f(first[k])
        for r in range(1, p):
            row = own[o:o + t] if r == me else rows[r, o:o + t]
            for k in range(t):
                acc[k] += _bf2f(row[k])
        if mode == 1:
            for k in range(t):
                acc[k] = acc[k] / s
        elif mode == 2:
            for k in range(t):
                acc[k] = acc[k] * s
        dst = out[o:o + t]
        for k in range(t):
            dst[k] = _f2bf(acc[k])


@_jit
def max_bf16(rows, own, me, out, mode, scale):  # noqa: ARG001
    """out = the maximum (exact; NaN propagates) of the rows, in float32 in row order, rounded once."""
    p, m = rows.shape
    tile = np.empty(_TILE, np.float32)
    for o in range(0, m, _TILE):
        t = min(_TILE, m - o)
        acc = tile[:t]
        first = own[o:o + t] if me == 0 else rows[0, o:o + t]
        for k in range(t):
            acc[k] = _bf2f(first[k])
        for r in range(1, p):
            row = own[o:o + t] if r == me else rows[r, o:o + t]
            for k in range(t):
                v = _bf2f(row[k])
                a = acc[k]
                acc[k] = v if (v > a or v != v) else a
        dst = out[o:o + t]
        for k in range(t):
            dst[k] = _f2bf(acc[k])


@_jit
def min_bf16(rows, own, me, out, mode, scale):  # noqa: ARG001
    """out = the minimum (exact; NaN propagates) of the rows, in float32 in row order, rounded once."""
    p, m = rows.shape
    tile = np.empty(_TILE, np.float32)
    for o in range(0, m, _TILE):
        t = min(_TILE, m - o)
        acc = tile[:t]
        first = own[o:o + t] if me == 0 else rows[0, o:o + t]
        for k in range(t):
            acc[k] = _bf2f(first[k])
        for r in range(1, p):
            row = own[o:o + t] if r == me else rows[r, o:o + t]
            for k in range(t):
                v = _bf2f(row[k])
                a = acc[k]
                acc[k] = v if (v < a or v != v) else a
        dst = out[o:o + t]
        for k in range(t):
            dst[k] = _f2bf(acc[k])


@_jit
def sum_f16(rows, own, me, out, mode, scale):
    """out = the sum (mode 1: divided by scale, 2: times scale) of the rows, in float32 in row order, rounded once."""
    p, m = rows.shape
    s = np.float32(scale)
    tile = np.empty(_TILE, np.float32)
    for o in range(0, m, _TILE):
        t = min(_TILE, m - o)
        acc = tile[:t]
        first = own[o:o + t] if me == 0 else rows[0, o:o + t]
        for k in range(t):
            acc[k] = _h2f(first[k])
        for r in range(1, p):
            row = own[o:o + t] if r == me else rows[r, o:o + t]
            for k in range(t):
                acc[k] += _h2f(row[k])
        if mode == 1:
            for k in range(t):
                acc[k] = acc[k] / s
        elif mode == 2:
            for k in range(t):
                acc[k] = acc[k] * s
        dst = out[o:o + t]
        for k in range(t):
            dst[k] = _f2h(acc[k])


@_jit
def max_f16(rows, own, me, out, mode, scale):  # noqa: ARG001
    """out = the maximum (exact; NaN propagates) of the rows, in float32 in row order, rounded once."""
    p, m = rows.shape
    tile = np.empty(_TILE, np.float32)
    for o in range(0, m, _TILE):
        t = min(_TILE, m - o)
        acc = tile[:t]
        first = own[o:o + t] if me == 0 else rows[0, o:o + t]
        for k in range(t):
            acc[k] = _h2f(first[k])
        for r in range(1, p):
            row = own[o:o + t] if r == me else rows[r, o:o + t]
            for k in range(t):
                v = _h2f(row[k])
                a = acc[k]
                acc[k] = v if (v > a or v != v) else a
        dst = out[o:o + t]
        for k in range(t):
            dst[k] = _f2h(acc[k])


@_jit
def min_f16(rows, own, me, out, mode, scale):  # noqa: ARG001
    """out = the minimum (exact; NaN propagates) of the rows, in float32 in row order, rounded once."""
    p, m = rows.shape
    tile = np.empty(_TILE, np.float32)
    for o in range(0, m, _TILE):
        t = min(_TILE, m - o)
        acc = tile[:t]
        first = own[o:o + t] if me == 0 else rows[0, o:o + t]
        for k in range(t):
            acc[k] = _h2f(first[k])
        for r in range(1, p):
            row = own[o:o + t] if r == me else rows[r, o:o + t]
            for k in range(t):
                v = _h2f(row[k])
                a = acc[k]
                acc[k] = v if (v < a or v != v) else a
        dst = out[o:o + t]
        for k in range(t):
            dst[k] = _f2h(acc[k])


#: (dtype name, op kind) -> kernel(rows uint16[p, m], own uint16[m], me, out uint16[m], mode,
#: scale): row ``me`` is read from ``own`` instead (-1: none); op kind 0 sum (mode 0 plain,
#: 1 divide by scale, 2 multiply by scale), 1 max, 2 min.
KERNELS = {("bfloat16", 0): sum_bf16, ("bfloat16", 1): max_bf16, ("bfloat16", 2): min_bf16,
           ("float16", 0): sum_f16, ("float16", 1): max_f16, ("float16", 2): min_f16}
