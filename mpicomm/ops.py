"""Reduction operations and their MPI counterparts."""
from __future__ import annotations

import enum

from mpi4py import MPI

from .errors import check_type


class ReduceOp(enum.Enum):
    """Reductions accepted by all_reduce and reduce_scatter_tensor."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PROD = "prod"

    def __str__(self) -> str:  # "ReduceOp.SUM" reads better in errors than "<ReduceOp.SUM: 'sum'>"
        return f"ReduceOp.{self.name}"


_BY_NAME = {op.value: op for op in ReduceOp}

# Arithmetic reductions on MPI's side; AVG is a SUM followed by a division.
MPI_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.AVG: MPI.SUM,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.PROD: MPI.PROD,
}
# On bool buffers SUM/MAX mean "any" and MIN/PROD mean "all" (torch's convention).
MPI_BOOL_OPS = {
    ReduceOp.SUM: MPI.LOR,
    ReduceOp.MAX: MPI.LOR,
    ReduceOp.MIN: MPI.LAND,
    ReduceOp.PROD: MPI.LAND,
}


def parse_op(op, call: str) -> ReduceOp:
    """Return the ReduceOp for ``op`` (a ReduceOp, a name like "sum", or torch.distributed's ReduceOp)."""
    if type(op) is ReduceOp:
        return op
    if isinstance(op, str):
        found = _BY_NAME.get(op.lower())
        if found is not None:
            return found
    else:
        # torch.distributed.ReduceOp / RedOpType values print as e.g. "RedOpType.SUM".
        name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
        found = _BY_NAME.get(str(name).lower())
        if found is not None:
            return found
    check_type(call, "op", op, "one of " + ", ".join(repr(v) for v in _BY_NAME), ok=False)
    raise AssertionError("unreachable")
