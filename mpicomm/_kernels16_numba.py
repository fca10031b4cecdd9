"""Fused numba kernels for 16-bit reductions (imported only when numba is present).

The kernel, ``reduce_rows``, reads ``rows`` (p rows of one block, 16-bit patterns as uint16),
combines them element by element in float32 in row order (row 0 first), applies the scale and
writes one 16-bit result, rounded once to nearest-even: one pass over the inputs, one store.
Same results, bit for bit, as ``kernels16.reduce_rows_torch`` (torch's float32 arithmetic and
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
def _load(bits, bf16):
    """A 16-bit pattern as float32 (``bf16``: bfloat16, else float16)."""
    return _bf2f(bits) if bf16 else _h2f(bits)


@_jit
def _store(x, bf16):
    """float32 rounded once to a 16-bit pattern (``bf16``: bfloat16, else float16)."""
    return _f2bf(x) if bf16 else _f2h(x)


@_jit
def reduce_rows(rows, own, me, out, mode, scale, kind, bf16):
    """out = the rows (uint16[p, m]; row ``me`` read from ``own`` instead, -1: none) combined
    by ``kind`` (0 sum, 1 max, 2 min) in float32 in row order, the sum scaled (mode 1: divided
    by scale, 2: times scale), rounded once; max and min exact (a NaN propagates).

    One kernel for {sum, max, min} x {bfloat16, float16} (six near-copies before): ``kind``
    and ``bf16`` hold for a whole call, so LLVM unswitches the loops on them and each runs as
    its own vector loop. Measured on 16 MiB (p = 2, median of 9, side by side with the six):
    0.85x-1.00x their time, same bits; numba's ``cache=True`` keeps it (one signature). A
    factory of six closures kept the speed but not the cache (numba recompiled them in every
    process)."""
    p, m = rows.shape
    s = np.float32(scale)
    tile = np.empty(_TILE, np.float32)
    for o in range(0, m, _TILE):
        t = min(_TILE, m - o)
        acc = tile[:t]
        first = own[o:o + t] if me == 0 else rows[0, o:o + t]
        for k in range(t):
            acc[k] = _load(first[k], bf16)
        for r in range(1, p):
            row = own[o:o + t] if r == me else rows[r, o:o + t]
            if kind == 0:
                for k in range(t):
                    acc[k] += _load(row[k], bf16)
            elif kind == 1:
                for k in range(t):
                    v = _load(row[k], bf16)
                    a = acc[k]
                    acc[k] = v if (v > a or v != v) else a
            else:
                for k in range(t):
                    v = _load(row[k], bf16)
                    a = acc[k]
                    acc[k] = v if (v < a or v != v) else a
        if kind == 0 and mode == 1:
            for k in range(t):
                acc[k] = acc[k] / s
        elif kind == 0 and mode == 2:
            for k in range(t):
                acc[k] = acc[k] * s
        dst = out[o:o + t]
        for k in range(t):
            dst[k] = _store(acc[k], bf16)
