"""DeepSpeed interoperability: import ZeRO checkpoints, export DeepSpeed's universal layout."""
from __future__ import annotations

from .api import from_deepspeed, to_deepspeed_universal
from .pickles import PickleRefusedError
from .reader import DeepSpeedFormatError, DeepSpeedState, read_deepspeed
from .universal import write_universal

__all__ = [
    "DeepSpeedFormatError", "DeepSpeedState", "PickleRefusedError", "from_deepspeed", "read_deepspeed",
    "to_deepspeed_universal", "write_universal",
]
