"""Argument validation: every error says which call, which argument, what was expected and what arrived."""
from __future__ import annotations

from typing import NoReturn

from . import dtypes


class CollectiveMismatchError(RuntimeError):
    """Ranks called a collective with arguments that do not agree (raised on every rank)."""


def describe(obj) -> str:
    """Short description of a buffer or value for error messages."""
    shape = getattr(obj, "shape", None)
    dtype = getattr(obj, "dtype", None)
    if shape is not None and dtype is not None:
        kind = type(obj).__module__.split(".")[0]
        device = getattr(obj, "device", None)
        where = f" on {device}" if device is not None and str(device) != "cpu" else ""
        return f"{kind} {dtypes.name(dtype)} of shape {tuple(shape)}{where}"
    return f"{type(obj).__name__} {obj!r}"


def check_type(call: str, arg: str, value, expected: str, ok: bool) -> None:
    """Raise TypeError unless ``ok``."""
    if not ok:
        raise TypeError(f'{call} got unexpected type for argument "{arg}" '
                        f"(expected: {expected}, got: {describe(value)})")


def fail_value(call: str, arg: str, expected: str, got: str) -> NoReturn:
    """Raise ValueError naming the call, the argument, what was expected and what arrived."""
    raise ValueError(f'{call} got unexpected value for argument "{arg}" (expected: {expected}, got: {got})')


def check_rank(call: str, arg: str, value, size: int) -> int:
    """Return ``value`` as a rank of a communicator of ``size``, or raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np

            if isinstance(value, np.integer):
                value = int(value)
        except ImportError:  # pragma: no cover
            pass
    if isinstance(value, bool) or not isinstance(value, int):
        check_type(call, arg, value, "an int rank", ok=False)
    if not 0 <= value < size:
        fail_value(call, arg, f"a rank in [0, {size - 1}]", str(value))
    return value
