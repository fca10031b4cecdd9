"""Copies of replicated state values kept in memory per commit, and their restore."""
from __future__ import annotations

import copy
import random
from typing import Any

import torch

_PLAIN = (int, float, bool, str, bytes, complex, type(None))


def _copyable(value: Any) -> bool:
    if isinstance(value, _PLAIN) or isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return all(_copyable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, _PLAIN) and _copyable(v) for k, v in value.items())
    try:
        import numpy as np
        if isinstance(value, (np.ndarray, np.generic)):
            return True
    except ImportError:  # pragma: no cover
        pass
    return False


def check(name: str, value: Any) -> None:
    """Raise TypeError naming ``name`` when ``value`` cannot be kept per commit."""
    if _copyable(value) or isinstance(value, (torch.Generator, random.Random)):
        return
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return
    raise TypeError(
        f"elastic.TorchState: attribute {name!r} of type {type(value).__name__} cannot be replicated; "
        "expected a number, string, None, tensor, numpy array, list/tuple/dict of those, "
        "torch.Generator, random.Random, or an object with state_dict()/load_state_dict()")


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return copy.deepcopy(value)


def save(value: Any) -> tuple[str, Any]:
    """A copy of ``value`` that ``restore`` turns back into it (or loads into it)."""
    if isinstance(value, torch.Generator):
        return "generator", value.get_state()
    if isinstance(value, random.Random):
        return "random", value.getstate()
    if not _copyable(value):
        return "stateful", _clone(value.state_dict())
    return "value", _clone(value)


def restore(current: Any, saved: tuple[str, Any]) -> Any:
    """The value to set back: ``current`` loaded from ``saved`` in place, or a fresh copy."""
    kind, data = saved
    if kind == "generator":
        current.set_state(data)
        return current
    if kind == "random":
        current.setstate(data)
        return current
    if kind == "stateful":
        current.load_state_dict(_clone(data))
        return current
    return _clone(data)


def state_dict_copy(module_or_opt: Any) -> Any:
    """A detached deep copy of ``module_or_opt.state_dict()``."""
    return _clone(module_or_opt.state_dict())


def nbytes(value: Any) -> int:
    """Bytes held by the tensors inside ``value``."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0
