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


# the value of torch's RedOpType -> mpicomm's ReduceOp (hashing or comparing torch's enum
# members costs ~0.2-0.5 us each; their integer value is read in ~0.1)
_BY_VALUE = {int(kind): getattr(ReduceOp, member) for kind, member in _NAMES.items()
             if hasattr(ReduceOp, member)}
_PREMUL_VALUE = int(_RED.PREMUL_SUM)


def to_mpicomm(red_op, call: str) -> tuple[ReduceOp, "float | torch.Tensor | None"]:
    """(mpicomm ReduceOp, factor) for torch's op; PREMUL_SUM is SUM after scaling by factor."""
    value = getattr(getattr(red_op, "op", red_op), "value", None)
    ours = _BY_VALUE.get(value) if type(value) is int else None
    if ours is None:
        supported = [f"ReduceOp.{k.name}" for k, m in _NAMES.items() if hasattr(ReduceOp, m)]
        raise ValueError(f"mpicomm process group: {call} does not support {op_name(red_op)} "
                         f"(supported: {', '.join(supported)})")
    factor = None
    if value == _PREMUL_VALUE:
        factor = getattr(red_op, "factor", None)
        if factor is None:      # torch before 2.13 keeps PREMUL_SUM's factor in C++ only
            import torch

            raise ValueError(f"mpicomm process group: {call} with {op_name(red_op)} needs torch >= 2.13 "
                             f"(ReduceOp.factor); this is torch {torch.__version__}: scale the "
                             "tensor and use ReduceOp.SUM")
    return ours, factor
