"""Nested state (dicts, lists, tuples, tensors, numbers, strings) as JSON plus a list of tensors.

Tensors become ``{"@tensor": k}`` (the k-th tensor, stored raw in the data file); tuples
``{"@tuple": [...]}``; a dict whose keys are not all plain strings ``{"@items": [[key, value],
...]}``; numpy scalars their Python value. Anything else is refused, naming where it was.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .dtypes import DTYPES
from .errors import IncompatibleStateError

_MARKS = ("@tensor", "@tuple", "@items", "@float")


def encode(value: Any, what: str, tensors: list[torch.Tensor]) -> Any:
    """``value`` as JSON data; its tensors are appended to ``tensors`` (detached, contiguous)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"@float": repr(value)}
    if isinstance(value, torch.Tensor):
        if value.dtype not in DTYPES.values():
            raise IncompatibleStateError(f"{what}: cannot store a tensor of dtype {value.dtype}: expected one of "
                                         f"{sorted(DTYPES)}")
        from .dtensor import is_dtensor

        tensors.append(value if is_dtensor(value) else value.detach().contiguous())  # a DTensor: its shard
        return {"@tensor": len(tensors) - 1}
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return encode(value.item(), what, tensors)
    if isinstance(value, tuple):
        return {"@tuple": [encode(v, f"{what}[{i}]", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{what}[{i}]", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k in _MARKS for k in value):
            return {k: encode(v, f"{what}.{k}", tensors) for k, v in value.items()}
        return {"@items": [[encode(k, f"{what} key {k!r}", tensors), encode(v, f"{what}[{k!r}]", tensors)]
                           for k, v in value.items()]}
    raise IncompatibleStateError(
        f"{what}: cannot store a {type(value).__module__}.{type(value).__qualname__}: expected a tensor, a number, "
        "a string, None, or a dict/list/tuple of those (an object with state_dict() at the top of state=)")


def decode(data: Any, tensors: list[torch.Tensor]) -> Any:
    """The value ``encode`` turned into ``data``, with its tensors taken from ``tensors``."""
    if isinstance(data, list):
        return [decode(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (mark, inner), = data.items()
        if mark == "@tensor":
            return tensors[inner]
        if mark == "@tuple":
            return tuple(decode(v, tensors) for v in inner)
        if mark == "@items":
            return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in inner}
        if mark == "@float":
            return float(inner)
    return {k: decode(v, tensors) for k, v in data.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
