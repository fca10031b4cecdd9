"""Saving and loading a ``ZeroOptimizer``: each rank writes and reads only its shard of the fp32
masters and of every per-element optimizer state, at any world size and stage."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from zero import Segment, ZeroOptimizer

from .. import byte_ranges
from ..dtypes import DTYPES, dtype_name
from ..errors import IncompatibleStateError
from ..io_plan import ReadPlan, SavePlan
from ..manifest import Manifest, ManifestError
from ..model_state import ModelState
from ..stateful import is_per_rank
from .base import OptimizerPlanner, SavedOptimizer, split_state, unscalar


def zero_padding(t: torch.Tensor, segments: list[Segment]) -> None:
    """Zero the elements of a local shard that no segment covers."""
    pos = 0
    for s in sorted(segments, key=lambda s: s.local):
        if s.local > pos:
            t[pos:s.local].zero_()
        pos = s.local + s.length
    if pos < t.numel():
        t[pos:].zero_()


class ZeroPlanner(OptimizerPlanner):
    """Sharded fp32 masters and state; fp32 model weights are stored as the masters' bytes."""

    optimizer: ZeroOptimizer

    @property
    def stage(self) -> int:  # type: ignore[override]
        return self.optimizer.stage

    def class_name(self) -> str:
        cls = self.optimizer.optimizer_class
        return f"{cls.__module__}.{cls.__qualname__}"

    def communicator(self) -> Any:
        return self.optimizer.comm

    def check_size(self, size: int, what: str) -> None:
        if self.optimizer.comm.size != size:
            raise IncompatibleStateError(f"{what}: the optimizer shards over {self.optimizer.comm.size} ranks "
                                         f"but comm has {size}")

    def _ids(self) -> set[int]:
        if getattr(self, "_param_ids", None) is None:
            self._param_ids = {id(p) for p in self.params()}
        return self._param_ids

    def saves_weights(self, t: torch.Tensor) -> bool:
        # fp32 weights are the masters' bytes; with a quantized gather (gather_bits) the model's
        # working copy is not exact, so weights of any dtype are saved from the masters
        exact = t.dtype == torch.float32 or getattr(self.optimizer, "gather_bits", None) is not None
        return exact and id(t) in self._ids()

    def loads_weights(self, t: torch.Tensor) -> bool:
        return id(t) in self._ids()  # gathered from the masters after the load

    def prepare_save(self, size: int) -> list[dict[str, Any]]:
        """Every group's shard state (handed to ``plan_save``)."""
        self.check_size(size, "save")
        # collective for OnebitAdam after freeze_step (the exact mean momentum): every rank,
        # every group, in order, in a step with nothing else that could fail on one rank first
        return [self.optimizer.shard_state(gi) for gi in range(len(self.optimizer.groups))]

    def plan_save(self, prepared: list[dict[str, Any]], model: ModelState, index: dict[int, int], sp: SavePlan,
                  rank: int) -> SavedOptimizer:
        zero, states = self.optimizer, prepared
        group_tensors: list[dict[str, torch.Tensor]] = []
        scalars: dict[str, dict[str, Any]] = {}
        self._check_inner_state()
        for gi, g in enumerate(zero.groups):
            tensors, group_scalars, others = split_state(states[gi], g.master.shape)
            if others:
                raise IncompatibleStateError(
                    f"save: {self.class_name()} state {sorted(others)} of param group {gi} is neither a tensor "
                    "of the shard's shape nor a number; a ZeroOptimizer checkpoint cannot store or reshard it")
            group_tensors.append(tensors)
            for p in g.params:
                scalars[str(index[id(p)])] = group_scalars
        for g in zero.groups:
            entries = {}
            for li, p in enumerate(g.params):
                i = index[id(p)]
                entries[li] = e = sp.packer.add(model.names[i], i, "master", p.shape, "float32")
                if p.dtype == torch.float32:
                    sp.packer.alias(e, "param")
            sp.own += byte_ranges.shard_items(g.layout.segments(rank), entries, sp.buffer(g.master))
            if g.params and g.dtype != torch.float32 and self.saves_weights(g.params[0]):
                cast = {li: sp.packer.add(model.names[index[id(p)]], index[id(p)], "param", p.shape,
                                          dtype_name(p.dtype)) for li, p in enumerate(g.params)}
                sp.own += byte_ranges.shard_items(g.layout.segments(rank), cast, sp.buffer(g.master.to(g.dtype)))
        keys: list[str] = []
        for tensors in group_tensors:
            keys += [k for k in tensors if k not in keys]
        for key in keys:
            for g, tensors in zip(zero.groups, group_tensors):
                t = tensors.get(key)
                if t is None:
                    continue
                entries = {li: sp.packer.add(model.names[index[id(p)]], index[id(p)], "state", p.shape,
                                             dtype_name(t.dtype), key) for li, p in enumerate(g.params)}
                sp.own += byte_ranges.shard_items(g.layout.segments(rank), entries, sp.buffer(t))
        return SavedOptimizer({"class": self.class_name(), "param_groups": self.groups_json(index), "scalars": scalars})

    def _check_inner_state(self) -> None:
        inner = self.optimizer.optimizer
        top = sorted(k for k in inner.state_dict() if k not in ("state", "param_groups"))
        if top and not is_per_rank(inner):
            raise IncompatibleStateError(
                f"save: {self.class_name()}.state_dict() holds {top} beside 'state' and 'param_groups'; under a "
                "ZeroOptimizer that state differs per rank and can only be stored through the per-rank protocol "
                "(per_rank_state_dict / load_per_rank_state_dict), which the optimizer class lacks")

    def per_rank_object(self) -> Any:
        inner = self.optimizer.optimizer
        return self.optimizer if is_per_rank(self.optimizer) else inner if is_per_rank(inner) else None

    def stepped_tensors(self, names: dict[int, str]) -> Iterator[tuple[torch.Tensor, str]]:
        """Besides the wrapped optimizer's state: the master shards and their state."""
        yield from super().stepped_tensors(names)
        for gi, g in enumerate(self.optimizer.groups):
            yield g.master, f"master shard of group {gi}"
            for key, t in self.optimizer.shard_state(gi).items():
                if isinstance(t, torch.Tensor) and t.numel():
                    yield t, f"optimizer state {key!r} of group {gi}"

    def plan_load(self, m: Manifest, by_id: dict[int, int], rp: ReadPlan, has_state: bool,
                  extra: Callable[[], Any] | None = None) -> None:
        zero = self.optimizer
        if extra is not None:
            raise IncompatibleStateError(
                "load: the checkpoint holds optimizer state beside the per-element tensors and scalars (entries "
                "of a plain optimizer's state_dict()) that a ZeroOptimizer cannot take; load it into the plain "
                "optimizer it was saved from")
        if has_state:
            self.check_groups(m, by_id)
        states = [self._plan_group(gi, m, by_id, rp, has_state) for gi in range(len(zero.groups))]
        hyper = self.hyperparams(m) if has_state else None

        def apply() -> None:
            if hyper is not None:
                for g, hp in zip(zero.param_groups, hyper):
                    g.update(hp)
            for gi, st in enumerate(states):
                zero.set_shard_state(gi, st)

        rp.apply.append(apply)

    def _plan_group(self, gi: int, m: Manifest, by_id: dict[int, int], rp: ReadPlan,
                    has_state: bool) -> dict[str, Any]:
        g = self.optimizer.groups[gi]
        ids = [by_id[id(p)] for p in g.params]
        segs = g.layout.segments(self.optimizer.rank)
        zero_padding(g.master, segs)
        src = {}
        for li, i in enumerate(ids):
            e = m.find("master", i) or m.find("param", i)
            if e is None:
                raise ManifestError(f"load: checkpoint has no weights for {m.params[i].name!r}")
            src[li] = e
        for dt in {e.dtype for e in src.values()}:
            rp.items += byte_ranges.shard_items(segs, {li: e for li, e in src.items() if e.dtype == dt}, rp.dest(g.master, dt))
        state: dict[str, Any] = {}
        for key in m.state_keys() if has_state else []:
            present = {li: e for li, i in enumerate(ids) if (e := m.find("state", i, key)) is not None}
            if not present:
                continue
            if len(present) != len(ids):
                raise ManifestError(f"load: state {key!r} is saved for some parameters of group {gi} only")
            dt = next(iter(present.values())).dtype
            # floating state lives in fp32 beside the fp32 masters, whatever dtype it was saved in
            kind = DTYPES[dt]
            t = torch.empty(g.layout.local_numel, dtype=torch.float32 if kind.is_floating_point else kind,
                            device=g.master.device)
            zero_padding(t, segs)
            state[key] = t
            rp.items += byte_ranges.shard_items(segs, present, rp.dest(t, dt))
        if has_state:
            saved = [m.optimizer["scalars"].get(str(i), {}) for i in ids]
            for key in saved[0] if saved else []:
                values = {repr(s.get(key)) for s in saved}
                if len(values) != 1:
                    raise IncompatibleStateError(f"load: group {gi} parameters have different {key!r}: "
                                                 f"{sorted(values)}; a ZeroOptimizer group needs one value")
                state[key] = unscalar(saved[0][key])
        return state

    def after_load(self) -> None:
        self.optimizer.gather_params()  # collective: the model weights from every rank's masters
