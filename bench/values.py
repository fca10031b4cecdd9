"""Check values of ``bench collectives``, computed in numpy alone: inputs, bfloat16 bits, results.

Host arrays hold each dtype's own bytes: numpy's dtype, except bfloat16 (which numpy lacks),
held as its uint16 bit pattern. Reductions of float16/bfloat16 follow mpicomm's documented
semantics: the 16-bit inputs are summed in float32 and the sum is rounded once to 16 bits.
The inputs are chosen so that this float32 sum is exact, so the expected bits do not depend on
the order of the reduction; for three or more ranks they differ from a 16-bit running sum.
"""
from __future__ import annotations

import numpy as np

__all__ = ["DTYPES", "SIXTEEN_BIT", "host_dtype", "bf16_bits", "bf16_value", "to_host",
           "as_float", "send_values", "expected", "count_wrong", "ulp_fraction"]

DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64")
SIXTEEN_BIT = ("float16", "bfloat16")
_FLOATS = ("float32", "float16", "bfloat16", "float64")
# relative size of one unit in the last place (an upper bound: 2**-mantissa_bits)
_ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}


def host_dtype(name: str) -> np.dtype:
    """The numpy dtype that holds ``name``'s bytes on the host (bfloat16: uint16)."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest, ties to even; NaN stays NaN): the uint16 bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    """The float32 values of bfloat16 bit patterns."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_host(values: np.ndarray, name: str) -> np.ndarray:
    """Round float64 (or exact integer) values once to dtype ``name``, in its host form."""
    if name == "bfloat16":
        return bf16_bits(np.asarray(values, dtype=np.float32))
    return np.asarray(values).astype(host_dtype(name))


def as_float(host: np.ndarray, name: str) -> np.ndarray:
    """Host-form values of dtype ``name`` as float64."""
    if name == "bfloat16":
        return bf16_value(host).astype(np.float64)
    return np.asarray(host).astype(np.float64)


def _pattern(rank: int, idx: np.ndarray, name: str) -> np.ndarray:
    """Rank-dependent values: small integers (times 65/64 for floating types, so that 16-bit types
    round them), plus 256, 512 or 768 on rank 0, where the others' small values are partly lost
    when each addition is rounded to 16 bits. Float32 sums of these stay exact."""
    base = (rank + 1) * (idx % 7 + 1)
    big = 256 * (1 + idx % 3) if rank == 0 else 0
    return to_host(base * (65 / 64) + big if name in _FLOATS else base + big, name)


def send_values(op: str, rank: int, count: int, per_rank: int, name: str) -> np.ndarray:
    """The check-phase send buffer of one rank, in host form."""
    length = per_rank if op == "all_gather" else count
    return _pattern(rank, np.arange(length), name)


def _sum_over_ranks(n: int, idx: np.ndarray, name: str) -> np.ndarray:
    """The reduction of every rank's input at ``idx``: summed exactly, rounded once."""
    total = np.zeros(idx.size, dtype=np.float64 if name in _FLOATS else np.int64)
    for s in range(n):
        part = _pattern(s, idx, name)
        total += as_float(part, name) if name in _FLOATS else part.astype(np.int64)
    return to_host(total, name)


def expected(op: str, rank: int, n: int, count: int, per_rank: int, name: str) -> np.ndarray:
    """The check-phase result on one rank, computed from the inputs alone (host form)."""
    if op == "all_reduce":
        return _sum_over_ranks(n, np.arange(count), name)
    if op == "reduce_scatter":
        return _sum_over_ranks(n, rank * per_rank + np.arange(per_rank), name)
    if op == "all_gather":
        return np.concatenate([_pattern(s, np.arange(per_rank), name) for s in range(n)])
    if op == "all_to_all":
        idx = rank * per_rank + np.arange(per_rank)
        return np.concatenate([_pattern(s, idx, name) for s in range(n)])
    if op == "broadcast":
        return _pattern(0, np.arange(count), name)
    raise ValueError(f"unknown op {op!r}; expected all_reduce, all_gather, reduce_scatter, "
                     "all_to_all or broadcast")


def ulp_fraction(name: str) -> float:
    """One unit in the last place of dtype ``name``, relative to the value (an upper bound)."""
    return _ULP.get(name, 0.0)


def count_wrong(got: np.ndarray, want: np.ndarray, name: str, ulps: int = 0) -> int:
    """Elements of ``got`` that differ from ``want``: bit for bit, or by more than ``ulps``
    units in the last place of a floating dtype."""
    if got.shape != want.shape:
        return int(want.size)
    if ulps == 0 or name not in _FLOATS:
        return int(np.count_nonzero(got.view(want.dtype) != want))
    g, w = as_float(got, name), as_float(want, name)
    return int(np.count_nonzero(np.abs(g - w) > ulps * _ULP[name] * np.abs(w)))
