"""Reduction operations and their MPI counterparts."""
from __future__ import annotations

import enum

from mpi4py import MPI



class ReduceOp(enum.Enum):
    """Reductions accepted by all_reduce, reduce and reduce_scatter_tensor."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PROD = "prod"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    # Members are singletons compared by identity: hash them by identity too (C-level, so that
    # a (dtype, op) table lookup on every call costs no Python-level __hash__ call).
    __hash__ = object.__hash__

    def __str__(self) -> str:  # "ReduceOp.SUM" reads better in errors than "<ReduceOp.SUM: 'sum'>"
        return f"ReduceOp.{self.name}"


_BY_NAME = {op.value: op for op in ReduceOp}
_BY_NAME["product"] = ReduceOp.PROD  # torch.distributed's spelling
#: Bitwise reductions: integer and bool buffers only.
BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)

# Reductions on MPI's side; AVG is a SUM followed by a division.
MPI_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.AVG: MPI.SUM,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.PROD: MPI.PROD,
    ReduceOp.BAND: MPI.BAND,
    ReduceOp.BOR: MPI.BOR,
    ReduceOp.BXOR: MPI.BXOR,
}
# On bool buffers SUM/MAX mean "any" and MIN/PROD mean "all" (torch's convention); the bitwise
# ops are their logical counterparts (MPI has no bitwise ops on C_BOOL).
MPI_BOOL_OPS = {
    ReduceOp.SUM: MPI.LOR,
    ReduceOp.MAX: MPI.LOR,
    ReduceOp.MIN: MPI.LAND,
    ReduceOp.PROD: MPI.LAND,
    ReduceOp.BAND: MPI.LAND,
    ReduceOp.BOR: MPI.LOR,
    ReduceOp.BXOR: MPI.LXOR,
}


def op_name(op) -> str:
    """A readable name for any op value: "ReduceOp.SUM", "'sum'", never "<... object at 0x...>"."""
    if type(op) is ReduceOp or isinstance(op, str):
        return str(op) if type(op) is ReduceOp else repr(op)
    kind = getattr(op, "op", op)  # torch.distributed.ReduceOp wraps a RedOpType in .op
    name = getattr(kind, "name", None)
    if isinstance(name, str):
        return f"{type(op).__name__}.{name}"
    return f"{type(op).__name__} {op!r}" if type(op).__repr__ is not object.__repr__ \
        else type(op).__name__


def parse_op(op, call: str) -> ReduceOp:
    """Return the ReduceOp for ``op`` (a ReduceOp, a name like "sum", or torch.distributed's ReduceOp)."""
    if type(op) is ReduceOp:
        return op
    if isinstance(op, str):
        found = _BY_NAME.get(op.lower())
    else:
        # torch.distributed.ReduceOp (.op is a RedOpType) or RedOpType (.name is e.g. "SUM").
        name = getattr(getattr(op, "op", op), "name", None)
        found = _BY_NAME.get(name.lower()) if isinstance(name, str) else None
    if found is not None:
        return found
    raise TypeError(f'{call} got unexpected type for argument "op" (expected: one of '
                    f"{', '.join(repr(v) for v in _BY_NAME)} or the matching ReduceOp, got: "
                    f"{op_name(op)})")
