"""Errors raised by the compressed allreduce."""
from __future__ import annotations


class NonFiniteError(FloatingPointError):
    """A compressed allreduce input held inf or NaN on some rank (raised on every rank, nothing modified)."""
