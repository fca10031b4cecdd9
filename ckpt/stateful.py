"""Stateful items of a checkpoint: ``state={name: obj}`` of ``save``/``load``, ``RNG`` and ``PerRank``.

An item is replicated (the same on every rank; saved once, loaded on every rank) or per rank
(each rank's own; every saved rank's state is kept). Per-rank objects follow one protocol:
``per_rank_state_dict()`` gives this rank's state, and ``load_per_rank_state_dict(saved, rank,
size)`` receives every saved rank's state in rank order and picks or combines what this rank
takes. ``RNG`` and ``PerRank`` implement it with the default rule ``same_rank``: rank r takes
saved rank r when the checkpoint has it, else a CheckpointError names the sizes (saved ranks
beyond the loading world size are not used).
"""
from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import torch

from .errors import IncompatibleStateError

Reshard = Callable[[list, int, int], Any]


def same_rank(saved: list, rank: int, size: int) -> Any:
    """The default rule for per-rank state: rank ``rank`` takes saved rank ``rank``."""
    if rank < len(saved):
        return saved[rank]
    raise IncompatibleStateError(
        f"per-rank state was saved by {len(saved)} rank(s) and is loaded at {size}: rank {rank} has no saved "
        f"state (the default rule gives rank r the state of saved rank r); load at {len(saved)} ranks or give "
        "ckpt.PerRank(obj, reshard=fn) a rule fn(saved, rank, size) -> state_dict")


def is_per_rank(obj: Any) -> bool:
    """Whether ``obj`` follows the per-rank protocol."""
    return callable(getattr(obj, "per_rank_state_dict", None)) and \
        callable(getattr(obj, "load_per_rank_state_dict", None))


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` has ``state_dict()`` and ``load_state_dict()``."""
    return not isinstance(obj, torch.Tensor) and callable(getattr(obj, "state_dict", None)) and \
        callable(getattr(obj, "load_state_dict", None))


class PerRank:
    """Store ``obj``'s ``state_dict()`` per rank. At load, ``reshard(saved, rank, size)`` (every
    saved rank's state dict, in rank order) gives the state dict this rank loads; the default
    rule is ``same_rank``."""

    def __init__(self, obj: Any, reshard: Reshard | None = None) -> None:
        if not is_stateful(obj):
            raise TypeError(f"PerRank: expected an object with state_dict() and load_state_dict(), got "
                            f"{type(obj).__name__}")
        self.obj = obj
        self.reshard = reshard or same_rank

    def per_rank_state_dict(self) -> Any:
        return self.obj.state_dict()

    def load_per_rank_state_dict(self, saved: list, rank: int, size: int) -> None:
        self.obj.load_state_dict(self.reshard(saved, rank, size))


class RNG:
    """This rank's random generators: Python ``random``, numpy's global generator, torch's CPU
    generator and, when CUDA is present, every CUDA device's. Per rank by itself (default rule
    ``same_rank``); ``reshard`` as for ``PerRank``."""

    def __init__(self, reshard: Reshard | None = None) -> None:
        self.reshard = reshard or same_rank

    def per_rank_state_dict(self) -> dict[str, Any]:
        npstate = np.random.get_state(legacy=False)
        state = {
            "python": random.getstate(),
            "numpy": {"bit_generator": npstate["bit_generator"],
                      "key": torch.from_numpy(npstate["state"]["key"].astype(np.int64)),
                      "pos": int(npstate["state"]["pos"]), "has_gauss": int(npstate["has_gauss"]),
                      "gauss": float(npstate["gauss"])},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_per_rank_state_dict(self, saved: list, rank: int, size: int) -> None:
        state = self.reshard(saved, rank, size)
        cuda = state.get("cuda")
        if cuda is not None and torch.cuda.is_available() and len(cuda) != torch.cuda.device_count():
            raise IncompatibleStateError(f"RNG: saved {len(cuda)} CUDA generator(s), this process sees "
                                         f"{torch.cuda.device_count()} device(s)")
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        n = state["numpy"]
        np.random.set_state({"bit_generator": n["bit_generator"],
                             "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
                             "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
        torch.set_rng_state(state["torch"])
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)


def plain_value(value: Any, what: str) -> Any:
    """``value`` with every stateful object inside replaced by its ``state_dict()``."""
    if is_per_rank(value):
        raise IncompatibleStateError(f"{what}: per-rank objects (ckpt.RNG, ckpt.PerRank, per_rank_state_dict) "
                                     "go at the top level of state=, not inside a container")
    if is_stateful(value):
        return value.state_dict()
    if isinstance(value, dict):
        return {k: plain_value(v, f"{what}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [plain_value(v, f"{what}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if isinstance(value, tuple) else out
    return value


def split_item(obj: Any, what: str) -> tuple[bool, Any, bool, Any]:
    """(has a replicated part, that part, has a per-rank part, that part) of a top-level item."""
    per_rank = is_per_rank(obj)
    mine = obj.per_rank_state_dict() if per_rank else None
    if per_rank and not is_stateful(obj):
        return False, None, True, mine
    return True, plain_value(obj, what), per_rank, mine


def restore(target: Any, value: Any, what: str) -> Any:
    """Load the saved replicated ``value`` into ``target`` in place where it can (stateful
    objects, tensors, dicts and lists: ``target`` is returned) or return ``value`` (numbers,
    strings: nothing to load into)."""
    if is_stateful(target):
        target.load_state_dict(value)
        return target
    if isinstance(target, torch.Tensor):
        if not isinstance(value, torch.Tensor) or value.shape != target.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise IncompatibleStateError(f"load: {what}: expected a tensor of shape {tuple(target.shape)}, "
                                         f"checkpoint has {got}")
        from .dtensor import copy_into

        copy_into(target, value)
        return target
    if isinstance(target, dict) and isinstance(value, dict):
        for k, v in value.items():
            target[k] = restore(target[k], v, f"{what}.{k}") if k in target else v
        return target
    if isinstance(target, list) and isinstance(value, (list, tuple)):
        if len(target) != len(value):
            if any(is_stateful(t) or is_per_rank(t) or isinstance(t, (torch.Tensor, dict, list)) for t in target):
                raise IncompatibleStateError(f"load: {what}: expected a list of {len(target)}, checkpoint has "
                                             f"{len(value)}")
            target[:] = list(value)
            return target
        for i, v in enumerate(value):
            target[i] = restore(target[i], v, f"{what}[{i}]")
        return target
    return value
