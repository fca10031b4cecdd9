"""The model's part of a checkpoint (pure, no MPI): its state in order, the weights every rank
packs or reads whole, and how a model matches a checkpoint's entries."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .dtypes import dtype_name
from .io_plan import ReadPlan, SavePlan
from .manifest import Manifest, ManifestError, ParamInfo

#: Which model tensors a step leaves to the optimizer planner.
Skip = Callable[[torch.Tensor], bool]


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


def plan_model_save(model: ModelState, sp: SavePlan, skip: Skip | None = None) -> None:
    """Pack every model tensor whole, except those ``skip`` names (the weights the optimizer
    planner saves)."""
    for i, (n, t) in enumerate(zip(model.names, model.tensors)):
        if skip is None or not skip(t):
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


def plan_model_load(model: ModelState, m: Manifest, match: Match, rp: ReadPlan, skip: Skip | None = None) -> None:
    """Read every matching model tensor whole (fp32 ones from the fp32 masters when saved),
    except those ``skip`` names (the weights the optimizer planner loads)."""
    midx = m.param_index()
    for n, t in zip(model.names, model.tensors):
        if id(t) not in match.by_id or (skip is not None and skip(t)):
            continue
        e = (m.find("master", midx[n]) if t.dtype == torch.float32 else None) or m.find("param", midx[n])
        if e is None:
            raise ManifestError(f"load: checkpoint has no weights for {n!r}")
        rp.whole(e, t)
