"""Errors raised by the compressed allreduce."""
from __future__ import annotations

from mpicomm import CollectiveMismatchError


class NonFiniteError(FloatingPointError):
    """A compressed allreduce input held inf or NaN on some rank (raised on every rank, nothing modified)."""


class SizeMismatchError(CollectiveMismatchError):
    """The ranks of a compressed allreduce passed different sizes (raised on every rank, nothing modified)."""
