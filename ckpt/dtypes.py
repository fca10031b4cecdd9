"""The names under which checkpoints store torch dtypes (one table for all of ckpt)."""
from __future__ import annotations

import torch

from mpicomm.dtypes import BY_NAME

from .errors import IncompatibleStateError

DTYPES: dict[str, torch.dtype] = dict(BY_NAME)  # "float32" -> torch.float32, ... (mpicomm's names)
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name for a torch dtype."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise IncompatibleStateError(f"cannot store a tensor of dtype {dtype}: expected a dtype in {sorted(DTYPES)}") from None
