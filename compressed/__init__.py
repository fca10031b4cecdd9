"""1-bit compressed allreduce (sign + scale with error feedback), 1-bit Adam and a DDP comm hook."""
from __future__ import annotations

from .backend import MpiBackend
from .errors import NonFiniteError
from .layout import padded_size

__all__ = ["MpiBackend", "NonFiniteError", "padded_size"]
