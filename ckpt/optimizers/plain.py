"""Saving and loading a plain torch optimizer: every rank holds the full state; each rank writes
an even share of it and reads all of it. Nothing of ``state_dict()`` is left out: state that is
neither a per-element tensor nor a number, and top-level entries beside 'state' and
'param_groups', are stored as the optimizer's extra state."""
from __future__ import annotations

from typing import Any, Callable

import torch

from .. import dtensor
from ..dtypes import DTYPES
from ..errors import IncompatibleStateError
from ..io_plan import ReadPlan, SavePlan
from ..manifest import Manifest
from ..model_state import ModelState
from .base import OptimizerPlanner, SavedOptimizer, split_state, unscalar

STANDARD_KEYS = ("state", "param_groups")


class PlainPlanner(OptimizerPlanner):
    """Full optimizer state, replicated on every rank."""

    def plan_save(self, prepared: Any, model: ModelState, index: dict[int, int], sp: SavePlan,
                  rank: int) -> SavedOptimizer:
        per_param: list[tuple[int, dict[str, torch.Tensor]]] = []
        scalars: dict[str, dict[str, Any]] = {}
        others: dict[str, dict[str, Any]] = {}
        keys: list[str] = []
        for p in self.params():
            i = index[id(p)]
            tensors, param_scalars, param_others = split_state(self.optimizer.state.get(p, {}), p.shape)
            per_param.append((i, tensors))
            if param_scalars:
                scalars[str(i)] = param_scalars
            if param_others:
                others[str(i)] = param_others
            keys += [k for k in tensors if k not in keys]
        for key in keys:
            for i, tensors in per_param:
                if key in tensors:
                    sp.whole(model.names[i], i, "state", tensors[key], key)
        top = {k: v for k, v in self.optimizer.state_dict().items() if k not in STANDARD_KEYS}
        entry = {"class": self.class_name(), "param_groups": self.groups_json(index), "scalars": scalars}
        return SavedOptimizer(entry, {"top": top, "params": others} if top or others else None)

    def plan_load(self, m: Manifest, by_id: dict[int, int], rp: ReadPlan, has_state: bool,
                  extra: Callable[[], Any] | None = None) -> None:
        if not has_state:
            return
        self.check_groups(m, by_id)
        params = self.params()
        state: dict[int, dict[str, Any]] = {}
        keys = m.state_keys()
        for pos, p in enumerate(params):
            i = by_id[id(p)]
            st: dict[str, Any] = {}
            for key in keys:
                e = m.find("state", i, key)
                if e is not None:
                    # a DTensor parameter gets its state as DTensors laid out like it: only its shard is read
                    st[key] = t = dtensor.like(p, DTYPES[e.dtype]) if dtensor.is_dtensor(p) \
                        else torch.empty(e.shape, dtype=DTYPES[e.dtype])
                    rp.whole(e, t)
            for key, d in m.optimizer["scalars"].get(str(i), {}).items():
                st[key] = unscalar(d)
            state[pos] = st
        position = {id(p): pos for pos, p in enumerate(params)}
        groups = [{**hp, "params": [position[id(p)] for p in g["params"]]}
                  for g, hp in zip(self.optimizer.param_groups, self.hyperparams(m))]
        pos_of = {by_id[id(p)]: pos for pos, p in enumerate(params)}

        def apply() -> None:
            saved = extra() if extra is not None else None
            sd: dict[str, Any] = {"state": state, "param_groups": groups}
            if saved is not None:
                for i, st in saved["params"].items():
                    state[pos_of[int(i)]].update(st)
                sd.update(saved["top"])
            try:
                self.optimizer.load_state_dict({**sd, "state": {k: v for k, v in state.items() if v}})
            except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
                raise IncompatibleStateError(f"load: {self.class_name()} refused the saved state of the "
                                             f"checkpoint: {type(exc).__name__}: {exc}") from None

        rp.apply.append(apply)
