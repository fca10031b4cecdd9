"""torch.distributed's ReduceOp mapped onto mpicomm's, with readable names for errors."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops import ReduceOp

_RED = dist.ReduceOp.RedOpType
# torch's reduction -> the name of mpicomm's ReduceOp member that performs it.
_NAMES = {_RED.SUM: "SUM", _RED.AVG: "AVG", _RED.MAX: "MAX", _RED.MIN: "MIN",
          _RED.PRODUCT: "PROD", _RED.BAND: "BAND", _RED.BOR: "BOR", _RED.BXOR: "BXOR",
          _RED.PREMUL_SUM: "SUM"}


def op_name(red_op) -> str:
    """"ReduceOp.SUM" for torch's ReduceOp / RedOpType (never "<... object at 0x...>")."""
    kind = getattr(red_op, "op", red_op)
    name = getattr(kind, "name", None)
    return f"ReduceOp.{name}" if name else repr(red_op)


def to_mpicomm(red_op, call: str) -> tuple[ReduceOp, "float | torch.Tensor | None"]:
    """(mpicomm ReduceOp, factor) for torch's op; PREMUL_SUM is SUM after scaling by factor."""
    kind = getattr(red_op, "op", red_op)
    member = _NAMES.get(kind)
    ours = getattr(ReduceOp, member, None) if member else None
    if ours is None:
        supported = [f"ReduceOp.{k.name}" for k, m in _NAMES.items() if hasattr(ReduceOp, m)]
        raise ValueError(f"mpicomm process group: {call} does not support {op_name(red_op)} "
                         f"(supported: {', '.join(supported)})")
    factor = red_op.factor if kind == _RED.PREMUL_SUM else None
    return ours, factor

