"""Low-level numba intrinsics of the CPU kernels: non-temporal ("streaming") stores and the fence
after them, and when a buffer may take them.

A plain store first reads each cache line it writes; a streaming store does not, which is what
makes the kernels' output passes run at copy speed (``_numba_kernels``: the fused encode's x,
64 MiB: 15.2 ms -> 10.5 ms; the decode, 8.2 ms -> 3.4 ms; memcpy 9.3 ms). x86-64 only (the
closing ``sfence``); elsewhere the kernels store plainly and ``sfence`` is a full fence.
"""
from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["NT_STORES", "nt_store", "nt_copy8", "sfence", "can_stream"]

#: Whether this machine takes the streaming stores (x86-64).
NT_STORES = platform.machine().lower() in ("x86_64", "amd64")


@intrinsic
def nt_store(typingctx, arr, idx, val):  # noqa: ARG001
    """arr[idx] = val as a non-temporal store that claims 32-byte alignment (vectorised loops
    over 32-byte aligned tiles only)."""
    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        ary = context.make_array(arrty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, arrty, ary, [args[1]], wraparound=False)
        store = builder.store(args[2], ptr, align=32)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()
    return types.void(arr, idx, val), codegen


@intrinsic
def sfence(typingctx):  # noqa: ARG001
    """Order the streaming stores before anything after them (x86 sfence)."""
    def codegen(context, builder, signature, args):
        if NT_STORES:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse.sfence")
            builder.call(fn, [])
        else:  # never streamed there; a full fence keeps this compilable everywhere
            builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def nt_copy8(typingctx, lut, r, v, out, base):  # noqa: ARG001
    """out[base:base + 8] = lut[r, v, :8] with two 16-byte non-temporal stores (``out`` must be
    16-byte aligned, as numpy and torch allocate float32 arrays)."""
    def codegen(context, builder, sig, args):
        lutty, _, _, outty, _ = sig.args
        la = context.make_array(lutty)(context, builder, args[0])
        zero = context.get_constant(types.intp, 0)
        src = cgutils.get_item_pointer(context, builder, lutty, la, [args[1], args[2], zero],
                                       wraparound=False)
        oa = context.make_array(outty)(context, builder, args[3])
        dst = cgutils.get_item_pointer(context, builder, outty, oa, [args[4]], wraparound=False)
        vty = ir.VectorType(ir.FloatType(), 4)
        md = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        for h in range(2):
            off = ir.Constant(ir.IntType(64), 4 * h)
            s = builder.bitcast(builder.gep(src, [off]), vty.as_pointer())
            d = builder.bitcast(builder.gep(dst, [off]), vty.as_pointer())
            store = builder.store(builder.load(s, align=4), d, align=16)
            store.set_metadata("nontemporal", md)
        return context.get_dummy_value()
    return types.void(lut, types.intp, types.intp, out, types.intp), codegen


def can_stream(out, align: int = 64) -> bool:
    """Whether kernels may store into ``out`` with streaming stores: x86-64, a start aligned to
    ``align`` bytes (64: whole 32-byte aligned tiles for ``nt_store``; 16: ``nt_copy8``),
    contiguous float32."""
    return NT_STORES and out.ctypes.data % align == 0 and out.strides[0] == 4
