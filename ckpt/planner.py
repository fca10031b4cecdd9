"""What each rank writes and reads (pure, no MPI): the model's weights, and one planner per
optimizer kind behind ``OptimizerPlanner`` (``planners.planner_for`` picks it; this module
imports no planner).

A save plan packs every tensor into the data file (``Packer``) and lists the byte ranges this
rank writes from which local buffer; a read plan lists the ranges this rank reads into which
destination, and the steps that hand what was read to the objects once every check passed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import dtensor, plan
from . import dtensor_layout as dl
from .dtypes import DTYPES, dtype_name
from .errors import IncompatibleStateError, StateMismatchError
from .manifest import DATA_NAME, Manifest, ManifestError, Packer, ParamInfo, jsonable, like
from .stateful import is_per_rank


@dataclass
class ModelState:
    """The model's state in order: names and tensors (tied tensors once), aliases, buffer names."""

    names: list[str]
    tensors: list[torch.Tensor]
    aliases: dict[str, str]
    buffers: set[str]

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelState":
        names, tensors, aliases, first = [], [], {}, {}
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) in first:
                aliases[name] = first[id(t)]
                continue
            first[id(t)] = name
            names.append(name)
            tensors.append(t)
        return cls(names, tensors, aliases, {n for n, _ in model.named_buffers()})

    def index(self) -> dict[int, int]:
        """id(tensor) -> its index in the model state."""
        return {id(t): i for i, t in enumerate(self.tensors)}

    def params(self) -> list[ParamInfo]:
        return [ParamInfo(n, tuple(t.shape), dtype_name(t.dtype), n in self.buffers)
                for n, t in zip(self.names, self.tensors)]


REPLICA_ALIGN = 4096  # a replicated shard is split among its holders at multiples of this many bytes


def _what(kind: str, name: str, key: str | None) -> str:
    return {"param": f"{name!r}", "master": f"master weights of {name!r}", "state": f"optimizer state {key!r} of "
            f"{name!r}"}.get(kind, f"{name!r}" if key is None else f"{key!r}")


def shard_runs(e: Any, s: dl.Sharding, buf: int) -> list[plan.IOItem]:
    """Items that move this rank's shard of DTensor layout ``s`` between entry ``e`` (the full
    tensor in the file) and local buffer ``buf``: runs of contiguous bytes, in local order."""
    isz = e.itemsize
    return [plan.IOItem(e.offset + f * isz, n * isz, buf, lo * isz) for f, lo, n in dl.runs(s.shape, s.mine())]


@dataclass
class SavePlan:
    """Entries packed in the data file, this rank's local buffers, and the items that move them:
    ``replicated`` (every rank holds them; each writes an even share) and ``own`` (this rank's)."""

    packer: Packer = field(default_factory=lambda: Packer(DATA_NAME))
    buffers: list[torch.Tensor] = field(default_factory=list)
    replicated: list[plan.IOItem] = field(default_factory=list)
    own: list[plan.IOItem] = field(default_factory=list)
    sharded: list[tuple[str, dl.Sharding]] = field(default_factory=list)  # DTensors: (what, layout)

    def buffer(self, t: torch.Tensor) -> int:
        self.buffers.append(t.detach() if t.is_contiguous() else t.detach().contiguous())
        return len(self.buffers) - 1

    def whole(self, name: str, param: int, kind: str, t: torch.Tensor, key: str | None = None) -> None:
        """Pack tensor ``t`` whole: held by every rank, or a DTensor, of which this rank writes its
        local shard (a shard held by several ranks, ``Replicate``, split among them)."""
        if dtensor.is_dtensor(t):
            what = _what(kind, name, key)
            s = dtensor.sharding(t, f"save: {what}")
            boxes = s.boxes()
            dl.check_cover(s.shape, boxes)
            e = self.packer.add(name, param, kind, s.shape, dtype_name(t.dtype), key,
                                [dl.as_json(b) for b in boxes])
            items = shard_runs(e, s, self.buffer(dtensor.local(t)))
            index, count = s.replicas()
            self.own += plan.share_items(items, count, index, REPLICA_ALIGN) if count > 1 else items
            self.sharded.append((what, s))
            return
        e = self.packer.add(name, param, kind, t.shape, dtype_name(t.dtype), key)
        self.replicated.append(plan.IOItem(e.offset, e.nbytes, self.buffer(t), 0))

    def table(self) -> list[tuple]:
        """What every rank must agree on: each entry's name, kind, key, shape, dtype and DTensor layout."""
        layouts = {what: s.key() for what, s in self.sharded}
        return [(e.name, e.kind, e.key, list(e.shape), e.dtype, layouts.get(_what(e.kind, e.name, e.key)))
                for e in self.packer.entries]

    def items(self, rank: int, size: int, block_size: int) -> list[plan.IOItem]:
        """What this rank writes: its share of the replicated items, and its own."""
        share = plan.share_items(sorted(self.replicated, key=lambda it: it.offset), size, rank, block_size)
        return share + self.own


@dataclass
class ReadPlan:
    """This rank's reads (items into destinations, converted from the file dtypes) and the steps
    that apply them once every check passed."""

    items: list[plan.IOItem] = field(default_factory=list)
    dests: list[torch.Tensor] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    apply: list[Callable[[], None]] = field(default_factory=list)
    sharded: list[tuple[str, dl.Sharding]] = field(default_factory=list)  # DTensors read: (what, layout)

    def dest(self, t: torch.Tensor, dtype: str) -> int:
        self.dests.append(t)
        self.dtypes.append(DTYPES[dtype])
        return len(self.dests) - 1

    def whole(self, e: Any, dest: torch.Tensor) -> None:
        """Read entry ``e`` into ``dest`` (through a contiguous copy when needed): whole, or only
        this rank's shard when ``dest`` is a DTensor."""
        s = None
        if dtensor.is_dtensor(dest):
            what = _what(e.kind, e.name, e.key)
            s = dtensor.sharding(dest, f"load: {what}")
            if s.shape != tuple(e.shape):
                raise StateMismatchError(f"load: {what}: expected global shape {list(s.shape)}, checkpoint has "
                                         f"{list(e.shape)}")
            self.sharded.append((what, s))
            dest = dtensor.local(dest)
        else:
            dest = dest.detach()
        if not dest.is_contiguous():
            tmp = torch.empty(dest.shape, dtype=dest.dtype, device=dest.device)
            self.apply.append(lambda d=dest, s=tmp: d.copy_(s))
            dest = tmp
        buf = self.dest(dest.view(-1), e.dtype)
        self.items += [plan.IOItem(e.offset, e.nbytes, buf, 0)] if s is None else shard_runs(e, s, buf)


class OptimizerPlanner:
    """Saves and loads one kind of optimizer. ``masters`` are the model tensors whose weights the
    planner itself saves and loads (ZeRO's fp32 masters); the model planner skips them."""

    stage: int | None = None

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def class_name(self) -> str:
        cls = type(self.optimizer)
        return f"{cls.__module__}.{cls.__qualname__}"

    def check_size(self, size: int, what: str) -> None:
        """Raise if the optimizer cannot be saved or loaded by ``size`` ranks."""

    def prepare_save(self, size: int) -> None:
        """Run on every rank as a save step of its own, before planning: the collective calls
        the optimizer needs to give its state (so no rank fails in between)."""
        self.check_size(size, "save")

    def saves_weights(self, t: torch.Tensor) -> bool:
        return False

    def loads_weights(self, t: torch.Tensor) -> bool:
        return False

    def plan_save(self, model: ModelState, index: dict[int, int], sp: SavePlan, rank: int) -> dict[str, Any]:
        """Add the optimizer's tensors to ``sp``; return its manifest entry (class, groups...)."""
        raise NotImplementedError

    def plan_load(self, m: Manifest, by_id: dict[int, int], rp: ReadPlan, has_state: bool,
                  extra: Callable[[], Any] | None = None) -> None:
        """Add the reads of the optimizer's part to ``rp`` and the steps that apply them;
        ``extra()`` gives the saved ``extra_state`` once read (None: nothing saved)."""
        raise NotImplementedError

    def after_load(self) -> None:
        """Collective work after the state is applied (e.g. gathering weights)."""

    def extra_state(self) -> tuple[bool, Any]:
        """The optimizer's state beyond per-parameter tensors and scalars (found by ``plan_save``):
        whether there is any, and what (plain data and tensors, stored as a state item)."""
        return False, None

    def per_rank_object(self) -> Any:
        """The object whose per-rank state (``per_rank_state_dict``) is saved beside the optimizer's."""
        return self.optimizer if is_per_rank(self.optimizer) else None

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


# -- the model's weights ----------------------------------------------------------------------

def plan_model_save(model: ModelState, opt: OptimizerPlanner | None, sp: SavePlan) -> None:
    """Pack every model tensor whole, except the weights the optimizer planner saves."""
    for i, (n, t) in enumerate(zip(model.names, model.tensors)):
        if opt is None or not opt.saves_weights(t):
            sp.whole(n, i, "param", t)


@dataclass
class Match:
    """How the model's state matches a checkpoint's: what is missing, unexpected or reshaped,
    and model tensor id -> checkpoint param index for the entries that match."""

    missing: list[str]
    unexpected: list[str]
    mismatched: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
    by_id: dict[int, int]

    @classmethod
    def of(cls, model: ModelState, m: Manifest) -> "Match":
        midx = m.param_index()
        names = set(model.names)
        missing = [n for n in model.names if n not in midx]
        unexpected = [p.name for p in m.params if p.name not in names]
        mismatched = {n: (tuple(t.shape), tuple(m.params[midx[n]].shape)) for n, t in zip(model.names, model.tensors)
                      if n in midx and tuple(m.params[midx[n]].shape) != tuple(t.shape)}
        by_id = {id(t): midx[n] for n, t in zip(model.names, model.tensors) if n in midx and n not in mismatched}
        return cls(missing, unexpected, mismatched, by_id)

    @property
    def complete(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def message(self, ckdir: str, hint: bool = True, unexpected: bool = True) -> str:
        parts = []
        if self.missing:
            parts.append(f"missing from the checkpoint ({len(self.missing)}): {self.missing}")
        if self.unexpected and unexpected:
            parts.append(f"unexpected, in the checkpoint but not the model ({len(self.unexpected)}): {self.unexpected}")
        if self.mismatched:
            parts.append(f"other shapes ({len(self.mismatched)}): " + ", ".join(
                f"{n!r} expected shape {a}, checkpoint has {b}" for n, (a, b) in self.mismatched.items()))
        counts = (f"(missing {len(self.missing)}, unexpected {len(self.unexpected)}, "
                  f"other shapes {len(self.mismatched)})")
        head = f"load: model state does not match the checkpoint {ckdir} {counts}: " if hint else ""
        return head + "; ".join(parts) + ("; pass strict=False to load the matching part" if hint else "")


def plan_model_load(model: ModelState, m: Manifest, match: Match, opt: OptimizerPlanner | None,
                    rp: ReadPlan) -> None:
    """Read every matching model tensor whole (fp32 ones from the fp32 masters when saved),
    except those the optimizer planner loads."""
    midx = m.param_index()
    for n, t in zip(model.names, model.tensors):
        if id(t) not in match.by_id or (opt is not None and opt.loads_weights(t)):
            continue
        e = (m.find("master", midx[n]) if t.dtype == torch.float32 else None) or m.find("param", midx[n])
        if e is None:
            raise ManifestError(f"load: checkpoint has no weights for {n!r}")
        rp.whole(e, t)


def check_optimizer_params(opt: OptimizerPlanner, match: Match, ckdir: str, strict: bool) -> None:
    """Every optimizer parameter must be a model tensor that the checkpoint holds in its shape."""
    if all(id(p) in match.by_id for p in opt.params()):
        return
    if strict or not (match.missing or match.mismatched):
        raise IncompatibleStateError("load: the optimizer holds parameters that are not in model.state_dict()")
    raise StateMismatchError(
        "load(strict=False): the optimizer holds parameters that the checkpoint lacks or holds in another shape, "
        "and optimizer state cannot be loaded in part: " + match.message(ckdir, hint=False, unexpected=False)
        + "; pass optimizer=None to load the matching model entries alone")
