"""DeepSpeed interoperability: import ZeRO checkpoints, export DeepSpeed's universal layout."""
from __future__ import annotations

from .pickles import PickleRefusedError
from .reader import DeepSpeedFormatError, DeepSpeedState, read_deepspeed
from .universal import write_universal

__all__ = [
    "DeepSpeedFormatError", "DeepSpeedState", "PickleRefusedError", "read_deepspeed", "write_universal",
]
