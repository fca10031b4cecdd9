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


def _clone(value: Any, reuse: Any = None) -> Any:
    """A detached deep copy of ``value``; tensors of ``reuse`` (an older copy of the same
    structure) are overwritten in place where shape, dtype and device match, sparing fresh memory."""
    if isinstance(value, torch.Tensor):
        if (isinstance(reuse, torch.Tensor) and reuse.shape == value.shape and reuse.dtype == value.dtype
                and reuse.device == value.device and reuse.layout == value.layout == torch.strided):
            return reuse.copy_(value.detach())
        return value.detach().clone()
    if isinstance(value, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: _clone(v, old.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        old = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(value) else [None] * len(value)
        return type(value)(_clone(v, o) for v, o in zip(value, old))
    return copy.deepcopy(value)


def save(value: Any, reuse: tuple[str, Any] | None = None) -> tuple[str, Any]:
    """A copy of ``value`` that ``restore`` turns back into it (or loads into it); ``reuse``: an
    older copy whose tensors may be overwritten."""
    old = reuse[1] if reuse is not None else None
    if isinstance(value, torch.Generator):
        return "generator", value.get_state()
    if isinstance(value, random.Random):
        return "random", value.getstate()
    if not _copyable(value):
        return "stateful", _clone(value.state_dict(), old)
    return "value", _clone(value, old)


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


def state_dict_copy(module_or_opt: Any, reuse: Any = None) -> Any:
    """A detached deep copy of ``module_or_opt.state_dict()`` (``reuse``: an older copy)."""
    return _clone(module_or_opt.state_dict(), reuse)


def tree_copy(value: Any, reuse: Any = None) -> Any:
    """A detached deep copy of a tree of tensors and plain values (``reuse``: an older copy)."""
    return _clone(value, reuse)


def nbytes(value: Any) -> int:
    """Bytes held by the tensors inside ``value``."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


def get_global_rng() -> dict[str, Any]:
    """The states of the global generators: torch's (CPU, and CUDA where initialised), numpy's
    and ``random``'s."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
        out["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return out


def set_global_rng(saved: dict[str, Any]) -> None:
    """Set the global generators back to ``get_global_rng``'s ``saved``."""
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["random"])
    if "cuda" in saved:
        torch.cuda.set_rng_state_all(saved["cuda"])
    if "numpy" in saved:
        import numpy as np
        np.random.set_state(saved["numpy"])
