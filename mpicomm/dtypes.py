"""Which dtypes go to MPI as they are, and which are upcast for arithmetic.

MPI has no bfloat16, float16 or float8 type. Moves (broadcast, gathers, all-to-all, p2p)
send their bytes unchanged. float8 dtypes only move: reducing them is an error. Reductions of
float16/bfloat16 are computed in float32 and rounded once: SUM, AVG, MAX and MIN by
``reduce16`` (16 bits on the wire, a fused float32 kernel), PROD by upcasting the buffer
(``UPCAST``), MPI's native float32 product and one rounding back.
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

# torch dtype -> MPI datatype, for data that MPI reduces natively.
NATIVE = {
    torch.float64: MPI.DOUBLE,
    torch.float32: MPI.FLOAT,
    torch.int64: MPI.INT64_T,
    torch.int32: MPI.INT32_T,
    torch.int16: MPI.INT16_T,
    torch.int8: MPI.INT8_T,
    torch.uint8: MPI.UINT8_T,
    torch.bool: MPI.C_BOOL,
}
# Dtypes MPI only moves: sent as opaque 2-byte or 1-byte units.
MOVE_ONLY = {
    torch.float16: MPI.UINT16_T,
    torch.bfloat16: MPI.UINT16_T,
    **{getattr(torch, n): MPI.UINT8_T for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                                "float8_e5m2fnuz", "float8_e8m0fnu")
       if hasattr(torch, n)},
}
# Dtypes reduced in float32.
UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32}

SUPPORTED = tuple(NATIVE) + tuple(MOVE_ONLY)
FLOATING = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

NUMPY_TO_TORCH = {
    np.dtype(np.float64): torch.float64,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.bool_): torch.bool,
}


def move_type(dtype: torch.dtype):
    """MPI datatype that moves ``dtype`` unchanged, or None if unsupported."""
    return NATIVE.get(dtype) or MOVE_ONLY.get(dtype)


def name(dtype) -> str:
    """A dtype's short name: "float32" for torch.float32, numpy.float32 or "float32"."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).replace("torch.", "")
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def supported_names() -> str:
    """Human-readable list of supported dtypes."""
    return ", ".join(name(d) for d in SUPPORTED)


def reducible_names() -> str:
    """Human-readable list of the dtypes reductions take."""
    return ", ".join(name(d) for d in SUPPORTED if d in NATIVE or d in UPCAST)


#: Name -> torch dtype of the standard (non-float8) dtypes: the names checkpoints store.
BY_NAME = {name(d): d for d in tuple(NATIVE) + (torch.float16, torch.bfloat16)}
