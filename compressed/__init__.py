"""1-bit compressed allreduce (sign + scale with error feedback), 1-bit Adam and a DDP comm hook."""
from __future__ import annotations

from .adam import OnebitAdam
from .allreduce import OnebitAllreduce
from .backend import MpiBackend
from .ddp_hook import OnebitDDPState, onebit_ddp_hook
from .errors import NonFiniteError
from .layout import padded_size

__all__ = ["MpiBackend", "OnebitAllreduce", "OnebitAdam", "OnebitDDPState", "onebit_ddp_hook",
           "NonFiniteError", "padded_size"]
