"""Planning the state items of a checkpoint (``state=``, and the parts of an optimizer beyond its
per-parameter tensors): what each rank writes and reads, and the manifest's ``state`` section.

An item's replicated part is written once (an even share by every rank) after checking that
every rank holds the same; its per-rank part is written by each rank for itself. Tensors lie
raw in the data file as entries of kind "item"; the rest is JSON in the manifest:
``{"value": ..., "tensors": [keys], "ranks": [{"value": ..., "tensors": [keys]}, ...]}``.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from . import byte_ranges, dtensor
from .dtypes import DTYPES, dtype_name
from .errors import IncompatibleStateError
from .manifest import Manifest, ManifestError
from .io_plan import ReadPlan, SavePlan
from .tree import decode, encode


@dataclass
class Captured:
    """One item's parts on this rank, encoded: JSON data and the tensors it refers to."""

    value: Any = None
    tensors: list[torch.Tensor] = field(default_factory=list)
    has_value: bool = False
    mine: Any = None
    mine_tensors: list[torch.Tensor] = field(default_factory=list)
    has_mine: bool = False

    def summary(self) -> tuple[int | None, Any, list[tuple[list[int], str]] | None]:
        """What the other ranks need: a digest of the replicated part, the per-rank part's JSON
        and its tensors' shapes and dtypes."""
        digest = None
        if self.has_value:
            digest = zlib.crc32(json.dumps(self.value, sort_keys=True).encode())
            for t in self.tensors:
                digest = zlib.crc32(json.dumps([list(t.shape), dtype_name(t.dtype)]).encode(), digest)
                if dtensor.is_dtensor(t):  # shards differ per rank; their layout is checked with the model's
                    continue
                digest = zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), digest)
        meta = [(list(t.shape), dtype_name(t.dtype)) for t in self.mine_tensors] if self.has_mine else None
        return digest, self.mine if self.has_mine else None, meta


def capture(value: Any, what: str, has_value: bool, mine: Any, has_mine: bool) -> Captured:
    """Encode an item's replicated part ``value`` and per-rank part ``mine``."""
    c = Captured(has_value=has_value, has_mine=has_mine)
    if has_value:
        c.value = encode(value, what, c.tensors)
    if has_mine:
        c.mine = encode(mine, f"{what} (per rank)", c.mine_tensors)
        if any(dtensor.is_dtensor(t) for t in c.mine_tensors):
            raise IncompatibleStateError(f"{what}: per-rank state holds a DTensor; a DTensor is one tensor "
                                         "sharded over ranks: save it in the replicated part (not in PerRank)")
    return c


def plan_save(name: str, prefix: str, c: Captured, summaries: list[tuple], rank: int, sp: SavePlan) -> dict:
    """Pack item ``name``'s tensors and plan this rank's writes; return its manifest entry.
    ``summaries`` is every rank's ``Captured.summary()``, in rank order."""
    out: dict[str, Any] = {}
    if c.has_value:
        digests = [s[0] for s in summaries]
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            raise IncompatibleStateError(
                f"save: {name} differs between ranks (rank 0 and rank(s) {differ[:8]}); state that differs per "
                "rank must be saved per rank: wrap the object in ckpt.PerRank(obj)")
        keys = []
        for k, t in enumerate(c.tensors):
            keys.append(f"{prefix}/{k}")
            sp.whole(name, -1, "item", t, keys[-1])
        out["value"], out["tensors"] = c.value, keys
    if c.has_mine:
        ranks = []
        for r, (_d, mine, meta) in enumerate(summaries):
            keys = []
            for k, (shape, dt) in enumerate(meta):
                keys.append(f"{prefix}@{r}/{k}")
                e = sp.packer.add(name, -1, "item", shape, dt, keys[-1])
                if r == rank:
                    sp.own.append(byte_ranges.IOItem(e.offset, e.nbytes, sp.buffer(c.mine_tensors[k]), 0))
            ranks.append({"value": mine, "tensors": keys})
        out["ranks"] = ranks
    return out


@dataclass
class Loaded:
    """An item's saved parts, filled in when the data has been read."""

    entry: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def has_value(self) -> bool:
        return "value" in self.entry

    @property
    def has_ranks(self) -> bool:
        return "ranks" in self.entry

    def value(self) -> Any:
        return decode(self.entry["value"], [self.tensors[k] for k in self.entry["tensors"]])

    def ranks(self) -> list[Any]:
        return [decode(r["value"], [self.tensors[k] for k in r["tensors"]]) for r in self.entry["ranks"]]


def plan_load(name: str, entry: dict[str, Any], m: Manifest, rp: ReadPlan, target: Any = None) -> Loaded:
    """Plan the reads of every tensor of item ``name`` (both parts, every saved rank's). Where
    ``target`` holds a DTensor at a saved tensor's place, only that DTensor's shard is read."""
    loaded = Loaded(entry)
    keys = list(entry.get("tensors", [])) + [k for r in entry.get("ranks", []) for k in r["tensors"]]
    found: dict[int, torch.Tensor] = {}
    if target is not None and "value" in entry:
        _dtensors(_plain(target), entry["value"], found)
    shards = {entry["tensors"][k]: t for k, t in found.items() if isinstance(k, int) and 0 <= k < len(keys)}
    for key in keys:
        e = m.find("item", -1, key)
        if e is None:
            raise ManifestError(f"load: {name}: the manifest has no tensor {key!r}")
        t = dtensor.like(shards[key], DTYPES[e.dtype]) if key in shards else torch.empty(e.shape, dtype=DTYPES[e.dtype])
        loaded.tensors[key] = t
        rp.whole(e, t)
    return loaded


def _plain(target: Any) -> Any:
    from .stateful import is_stateful

    return target.state_dict() if is_stateful(target) else target


def _dtensors(target: Any, data: Any, out: dict[int, torch.Tensor]) -> None:
    """The DTensors of ``target`` at the places of the encoded ``data``'s tensors: index -> DTensor."""
    if isinstance(data, dict) and len(data) == 1:
        (mark, inner), = data.items()
        if mark == "@tensor":
            if dtensor.is_dtensor(target):
                out[inner] = target
            return
        if mark == "@tuple":
            data = inner
    if isinstance(data, list) and isinstance(target, (list, tuple)):
        for t, d in zip(target, data):
            _dtensors(_plain(t), d, out)
    elif isinstance(data, dict) and isinstance(target, dict):
        for k, d in data.items():
            if k in target:
                _dtensors(_plain(target[k]), d, out)
