"""The names under which checkpoints store torch dtypes (one table for all of ckpt)."""
from __future__ import annotations

import torch

from .errors import IncompatibleStateError

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name for a torch dtype."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise IncompatibleStateError(f"cannot store a tensor of dtype {dtype}: expected a dtype in {sorted(DTYPES)}") from None
