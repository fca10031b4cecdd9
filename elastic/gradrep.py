"""Replicating a ZeroOptimizer shard by its gradient: what a rank sends its buddy at the first
update after a commit (the averaged gradient shard and the update's hyperparameters), and the
buddy's replay of that update on its replica at the next commit.

The rule (``gradient_commit``): a commit advances the ward's replica by replaying the ward's
update iff exactly one update of the shards happened since the previous commit, over the same
communicator, and its gradient reached the buddy; any other commit (the first, one after a
recovery or a resume, one after a skipped step or after several steps) sends the full shard."""
from __future__ import annotations

from typing import Any, Sequence

import torch

#: Tags of the gradient exchange: the hyperparameter vector, then one per group.
TAG = 29429


def gradient_commit(has_previous: bool, same_comm: bool, updates: int, received: bool) -> bool:
    """Whether a commit replays the ward's update (else it sends the full shard): a previous
    commit over the same communicator, exactly one update since it, its gradient received."""
    return has_previous and same_comm and updates == 1 and received


def _leaves(value: Any) -> list[Any]:
    """The numeric leaves of a hyperparameter value, in order (None, strings: none)."""
    if isinstance(value, (bool, int, float)):
        return [value]
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"expected scalar tensor hyperparameters, got shape {tuple(value.shape)}")
        return [value]
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _leaves(v)]
    return []


def encode(hyperparams: Sequence[dict[str, Any]], has_grad: Sequence[bool]) -> torch.Tensor:
    """A float64 vector of the groups' numeric hyperparameters (keys sorted) and which groups have
    a gradient: [length, has_grad..., values...] (float64 holds fp32/fp64 values and ints < 2**53
    exactly)."""
    vals: list[float] = [float(bool(h)) for h in has_grad]
    for hp in hyperparams:
        for k in sorted(hp):
            vals.extend(float(x) for x in _leaves(hp[k]))
    return torch.tensor([float(len(vals) + 1), *vals], dtype=torch.float64)


def _fill(template: Any, it: Any) -> Any:
    if isinstance(template, bool):
        return bool(next(it))
    if isinstance(template, int):
        return int(next(it))
    if isinstance(template, float):
        return float(next(it))
    if isinstance(template, torch.Tensor):
        return torch.tensor(next(it), dtype=template.dtype, device=template.device).reshape(template.shape)
    if isinstance(template, (tuple, list)):
        return type(template)(_fill(v, it) for v in template)
    return template


def decode(vec: torch.Tensor, template: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[bool]]:
    """The hyperparameters and gradient flags ``encode`` packed, structured as ``template`` (the
    receiver's own, same keys and types; non-numeric values are taken from it)."""
    n = int(vec[0]) if vec.numel() else 0
    mine = encode(template, [False] * len(template))
    if n != int(mine[0]) or vec.numel() < n:
        raise ValueError(f"elastic: the ward's hyperparameters do not match this rank's ({n - 1} values "
                         f"against {int(mine[0]) - 1}): every rank must build its ZeroOptimizer alike")
    values = vec[1:n].tolist()
    flags = [v != 0.0 for v in values[:len(template)]]
    it = iter(values[len(template):])
    out = [{k: _fill(hp[k], it) for k in sorted(hp)} for hp in template]
    return out, flags


def ward_state(pieces: Sequence[torch.Tensor], keys: Sequence[Sequence[str]],
               other: Sequence[dict[str, Any]]) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Split a replica's flat list (per group: master, then the elementwise state by ``keys``)
    into per-group masters and states (``other``: per group, the non-elementwise state, cloned)."""
    if len(pieces) != sum(1 + len(names) for names in keys):
        raise ValueError(f"elastic: a replica of {len(pieces)} pieces does not match its state names {keys}")
    masters, states, i = [], [], 0
    for names, rest in zip(keys, other):
        masters.append(pieces[i])
        st = {k: pieces[i + 1 + j] for j, k in enumerate(names)}
        st.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in rest.items()})
        states.append(st)
        i += 1 + len(names)
    return masters, states


def join(masters: Sequence[torch.Tensor], states: Sequence[dict[str, Any]],
         keys: Sequence[Sequence[str]]) -> list[torch.Tensor]:
    """The flat list ``ward_state`` split, from states after an update laid out by ``keys``."""
    out: list[torch.Tensor] = []
    for m, st, names in zip(masters, states, keys):
        missing = [k for k in names if k not in st]
        if missing:
            raise ValueError(f"elastic: the replayed update left no {missing} state (the shard has it)")
        out.append(m)
        out.extend(st[k] for k in names)
    return out
