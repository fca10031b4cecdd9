"""The optimizer planner interface: everything ``save`` and ``load`` ask of an optimizer (pure,
no MPI, except where a method says it is collective), and the per-parameter state helpers the
planners share.

``save`` calls, in order: ``communicator`` (when no ``comm`` is given), ``prepare_save`` (a step
of its own on every rank), ``check_in_model``, ``saves_weights`` (through the model's planning),
``plan_save``, ``per_rank_object``, and with ``snapshot='background'`` ``stepped_tensors``.
``load`` calls ``communicator``, ``check_load``, ``loads_weights``, ``plan_load``, then the steps
``plan_load`` queued, then ``after_load``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..dtypes import DTYPES, dtype_name
from ..errors import IncompatibleStateError, StateMismatchError
from ..io_plan import ReadPlan, SavePlan
from ..manifest import Manifest, jsonable, like
from ..model_state import Match, ModelState
from ..stateful import is_per_rank


@dataclass
class SavedOptimizer:
    """What ``plan_save`` planned: the manifest's optimizer entry (class, param groups, scalars)
    and the state beyond per-element tensors and scalars (None: there is none), which ``save``
    stores as a state item."""

    entry: dict[str, Any]
    extra: Any = None


class OptimizerPlanner:
    """Saves and loads one kind of optimizer. The planner may save and load some model tensors'
    weights itself (ZeRO's fp32 masters: ``saves_weights``, ``loads_weights``); the model's
    planning skips them."""

    stage: int | None = None

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def class_name(self) -> str:
        cls = type(self.optimizer)
        return f"{cls.__module__}.{cls.__qualname__}"

    def communicator(self) -> Any:
        """The communicator the optimizer works on, which ``save`` and ``load`` use when given
        none (None: the optimizer has none of its own)."""
        return None

    def check_size(self, size: int, what: str) -> None:
        """Raise if the optimizer cannot be saved or loaded by ``size`` ranks."""

    def prepare_save(self, size: int) -> Any:
        """Run on every rank as a save step of its own, before planning: check that ``size``
        ranks can save the optimizer, and make the collective calls it needs to give its state
        (so no rank fails in between). What it returns is handed to ``plan_save``."""
        self.check_size(size, "save")
        return None

    def check_in_model(self, index: dict[int, int]) -> None:
        """Raise unless every optimizer parameter is a model tensor (``index``: id -> position)."""
        if any(id(p) not in index for p in self.params()):
            raise IncompatibleStateError("save: the optimizer holds a parameter that is not in model.state_dict()")

    def saves_weights(self, t: torch.Tensor) -> bool:
        return False

    def loads_weights(self, t: torch.Tensor) -> bool:
        return False

    def plan_save(self, prepared: Any, model: ModelState, index: dict[int, int], sp: SavePlan,
                  rank: int) -> SavedOptimizer:
        """Add the optimizer's tensors to ``sp`` (``prepared``: what ``prepare_save`` returned);
        return its manifest entry and extra state."""
        raise NotImplementedError

    def check_load(self, match: Match, ckdir: str, strict: bool, size: int) -> None:
        """Raise unless the optimizer can take the checkpoint's state here: every parameter a
        model tensor that the checkpoint holds in its shape, and ``size`` ranks."""
        if not all(id(p) in match.by_id for p in self.params()):
            if strict or not (match.missing or match.mismatched):
                raise IncompatibleStateError("load: the optimizer holds parameters that are not in model.state_dict()")
            raise StateMismatchError(
                "load(strict=False): the optimizer holds parameters that the checkpoint lacks or holds in another "
                "shape, and optimizer state cannot be loaded in part: "
                + match.message(ckdir, hint=False, unexpected=False)
                + "; pass optimizer=None to load the matching model entries alone")
        self.check_size(size, "load")

    def plan_load(self, m: Manifest, by_id: dict[int, int], rp: ReadPlan, has_state: bool,
                  extra: Callable[[], Any] | None = None) -> None:
        """Add the reads of the optimizer's part to ``rp`` and the steps that apply them;
        ``extra()`` gives the saved extra state once read (None: nothing saved)."""
        raise NotImplementedError

    def after_load(self) -> None:
        """Collective work after the state is applied (e.g. gathering weights)."""

    def per_rank_object(self) -> Any:
        """The object whose per-rank state (``per_rank_state_dict``) is saved beside the optimizer's."""
        return self.optimizer if is_per_rank(self.optimizer) else None

    def stepped_tensors(self, names: dict[int, str]) -> Iterator[tuple[torch.Tensor, str]]:
        """The tensors besides the parameters that ``optimizer.step()`` changes, each with what
        to call it (``names``: id of a parameter -> its name)."""
        for p, st in self.optimizer.state.items():
            for key, t in st.items() if isinstance(st, dict) else ():
                if isinstance(t, torch.Tensor) and t.numel():
                    yield t, f"optimizer state {key!r} of {names.get(id(p), 'a parameter')!r}"

    def groups_json(self, index: dict[int, int]) -> list[dict[str, Any]]:
        out = []
        for gi, g in enumerate(self.optimizer.param_groups):
            d = {k: jsonable(v, f"param_groups[{gi}].{k}") for k, v in g.items() if k != "params"}
            d["params"] = [index[id(p)] for p in g["params"]]
            out.append(d)
        return out

    def check_groups(self, m: Manifest, by_id: dict[int, int]) -> None:
        want, got = m.optimizer["class"], self.class_name()
        if want != got:
            raise IncompatibleStateError(f"load: checkpoint holds {want} state, the optimizer is {got}")
        saved = m.optimizer["param_groups"]
        groups = self.optimizer.param_groups
        if len(saved) != len(groups):
            raise IncompatibleStateError(f"load: expected {len(groups)} param groups, checkpoint has {len(saved)}")
        for gi, (g, s) in enumerate(zip(groups, saved)):
            mine = [by_id.get(id(p)) for p in g["params"]]
            if mine != list(s["params"]):
                raise IncompatibleStateError(f"load: param group {gi} holds parameters {mine}, "
                                             f"checkpoint group has {s['params']}")

    def hyperparams(self, m: Manifest) -> list[dict[str, Any]]:
        """The saved hyperparameters of every group, with the tuple-ness of the current ones."""
        return [{k: like(g.get(k), v) for k, v in s.items() if k != "params"}
                for g, s in zip(self.optimizer.param_groups, m.optimizer["param_groups"])]


# -- scalars and per-parameter state ----------------------------------------------------------

def scalar(value: Any) -> dict[str, Any]:
    """A per-parameter scalar (a 0-d tensor, a number or None) as JSON, with its dtype."""
    if isinstance(value, torch.Tensor):
        return {"value": value.item(), "dtype": dtype_name(value.dtype)}
    return {"value": value, "dtype": None}


def unscalar(d: dict[str, Any]) -> Any:
    if d.get("dtype") is None:
        return d["value"]
    return torch.tensor(d["value"], dtype=DTYPES[d["dtype"]])


def split_state(state: dict[str, Any], shape: torch.Size) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """One parameter's state: per-element tensors (shaped like ``shape``), scalars (numbers and
    0-d tensors, as JSON), and the rest (other tensors and data)."""
    tensors, scalars, others = {}, {}, {}
    for key, v in state.items():
        if isinstance(v, torch.Tensor) and v.shape == shape and not (v.dim() == 0 and key == "step"):
            tensors[key] = v
        elif (isinstance(v, torch.Tensor) and v.dim() == 0) or isinstance(v, (bool, int, float)) or v is None:
            scalars[key] = scalar(v)
        else:
            others[key] = v
    return tensors, scalars, others
