"""Argument checks shared by the collectives: dtypes, ops, sizes, splits and per-rank lists."""
from __future__ import annotations

import torch
from mpi4py import MPI

from . import dtypes
from .buffers import to_tensor
from .errors import describe, fail_value
from .ops import BITWISE, MPI_BOOL_OPS, MPI_OPS, ReduceOp


def reduction(call: str, dtype: torch.dtype, op: ReduceOp):
    """(MPI datatype, wire dtype, MPI op) for reducing ``dtype`` with ``op``, or raise."""
    if dtype == torch.bool:
        if op is ReduceOp.AVG:
            fail_value(call, "op", "SUM, MAX, MIN, PROD, BAND, BOR or BXOR for a bool buffer",
                       str(op))
        return MPI.C_BOOL, dtype, MPI_BOOL_OPS[op]
    wire = dtypes.UPCAST.get(dtype, dtype)
    mpi_type = dtypes.NATIVE.get(wire)
    if mpi_type is None:
        moves = (f"; {dtypes.name(dtype)} only moves (broadcast, gathers, all_to_all, send/recv), "
                 "it is never reduced") if dtype in dtypes.MOVE_ONLY else ""
        raise TypeError(f'{call} got unexpected dtype for argument "tensor" (expected: one of '
                        f"{dtypes.reducible_names()}, got: {dtypes.name(dtype)}{moves})")
    if op is ReduceOp.AVG and dtype not in dtypes.FLOATING:
        fail_value(call, "op", "SUM, MAX, MIN, PROD, BAND, BOR or BXOR for an integer buffer "
                   "(AVG needs a floating dtype)", f"{op} on {dtypes.name(dtype)}")
    if op in BITWISE and dtype in dtypes.FLOATING:
        fail_value(call, "op", "SUM, AVG, MAX, MIN or PROD for a floating buffer (bitwise ops "
                   "need an integer or bool dtype)", f"{op} on {dtypes.name(dtype)}")
    return mpi_type, wire, MPI_OPS[op]


def move_type(call: str, arg: str, t: torch.Tensor):
    """MPI datatype that moves ``t``'s dtype unchanged, or raise."""
    mpi_type = dtypes.move_type(t.dtype)
    if mpi_type is None:
        raise TypeError(f'{call} got unexpected dtype for argument "{arg}" (expected: one of '
                        f"{dtypes.supported_names()}, got: {dtypes.name(t.dtype)})")
    return mpi_type


def same_dtype(call: str, arg: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    """Raise unless ``t`` has ``ref``'s dtype."""
    if t.dtype != ref.dtype:
        fail_value(call, arg, f"dtype {ref.dtype} (the dtype of the input)", str(t.dtype))


def same_device(call: str, arg: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    """Raise unless ``t`` is on ``ref``'s device."""
    if t.device != ref.device:
        fail_value(call, arg, f"a buffer on {ref.device} (where the input is)", str(t.device))


def out_and_in(call: str, names: tuple[str, str], output,
               input) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, input) of a two-buffer call as tensors, the output writable, both of one dtype
    on one device (or raise, naming the output's argument ``names[0]``)."""
    out = to_tensor(output, call, names[0], writable=True)
    inp = to_tensor(input, call, names[1], writable=False)
    same_dtype(call, names[0], out, inp)
    same_device(call, names[0], out, inp)
    return out, inp


def splits(call: str, arg: str, sizes, t: torch.Tensor, n: int) -> tuple[list[int], list[int]]:
    """Element counts and displacements for split sizes along dim 0 (None: equal splits)."""
    rows = t.shape[0] if t.dim() else 1
    row = t.numel() // rows if rows else 0
    if sizes is None:
        if rows % n:
            fail_value(call, arg, f"split sizes (dim 0 of size {rows} is not divisible by "
                       f"{n} ranks)", "None")
        sizes = [rows // n] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or any(s < 0 for s in sizes) or sum(sizes) != rows:
        fail_value(call, arg, f"{n} non-negative sizes summing to dim 0 = {rows}", str(sizes))
    counts = [s * row for s in sizes]
    displs = [0] * n
    for i in range(1, n):
        displs[i] = displs[i - 1] + counts[i - 1]
    return counts, displs


def per_rank_list(call: str, arg: str, items, ref: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``items`` as ``n`` tensors, each with ``ref``'s element count and dtype, or raise."""
    if not isinstance(items, (list, tuple)) or len(items) != n:
        fail_value(call, arg, f"a list of {n} buffers (one per rank)",
                   f"{type(items).__name__} of length {len(items)}"
                   if isinstance(items, (list, tuple)) else describe(items))
    out = []
    for i, item in enumerate(items):
        t = to_tensor(item, call, f"{arg}[{i}]", writable=True)
        if t.numel() != ref.numel() or t.dtype != ref.dtype:
            fail_value(call, f"{arg}[{i}]", f"{ref.numel()} elements of {ref.dtype}",
                       describe(item))
        out.append(t)
    return out


def root_list(call: str, arg: str, items, ref: torch.Tensor, root_arg: str, root: int,
              rank: int, n: int) -> list[torch.Tensor] | None:
    """Validate the per-rank list that only the root rank passes (None elsewhere)."""
    if rank == root:
        return per_rank_list(call, arg, items, ref, n)
    if items:
        fail_value(call, arg, f"None or [] on rank {rank} (only {root_arg}={root} uses it)",
                   f"a list of {len(items)}")
    return None
