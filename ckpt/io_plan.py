"""What this rank writes and reads (pure, no MPI): a save plan packs every tensor into the data
file (``Packer``) and lists the byte ranges this rank writes from which local buffer; a read plan
lists the ranges this rank reads into which destination, and the steps that hand what was read
to the objects once every check passed. The model's part is planned in ``model_state``, the
optimizer's in ``optimizers``, state items in ``items``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import byte_ranges, dtensor
from . import dtensor_layout as dl
from .dtypes import DTYPES, dtype_name
from .errors import StateMismatchError
from .manifest import DATA_NAME, Packer


REPLICA_ALIGN = 4096  # a replicated shard is split among its holders at multiples of this many bytes


def _what(kind: str, name: str, key: str | None) -> str:
    if kind == "param":
        return f"{name!r}"
    if kind == "master":
        return f"master weights of {name!r}"
    if kind == "state":
        return f"optimizer state {key!r} of {name!r}"
    return f"{name!r}" if key is None else f"{key!r}"


def shard_runs(e: Any, s: dl.Sharding, buf: int) -> list[byte_ranges.IOItem]:
    """Items that move this rank's shard of DTensor layout ``s`` between entry ``e`` (the full
    tensor in the file) and local buffer ``buf``: runs of contiguous bytes, in local order."""
    isz = e.itemsize
    return [byte_ranges.IOItem(e.offset + f * isz, n * isz, buf, lo * isz) for f, lo, n in _runs(s)]


_RUNS: dict[int, tuple[dl.Sharding, list[tuple[int, int, int]]]] = {}


def _runs(s: dl.Sharding) -> list[tuple[int, int, int]]:
    """``dl.runs`` of this rank's shard of ``s``, computed once per Sharding object (``dtensor.sharding``
    hands out one per layout and shape)."""
    hit = _RUNS.get(id(s))
    if hit is not None and hit[0] is s:
        return hit[1]
    if len(_RUNS) > 4096:
        _RUNS.clear()
    runs = dl.runs(s.shape, s.mine())
    _RUNS[id(s)] = (s, runs)
    return runs


@dataclass
class SavePlan:
    """Entries packed in the data file, this rank's local buffers, and the items that move them:
    ``replicated`` (every rank holds them; each writes an even share) and ``own`` (this rank's)."""

    packer: Packer = field(default_factory=lambda: Packer(DATA_NAME))
    buffers: list[torch.Tensor] = field(default_factory=list)
    replicated: list[byte_ranges.IOItem] = field(default_factory=list)
    own: list[byte_ranges.IOItem] = field(default_factory=list)
    sharded: list[tuple[str, dl.Sharding]] = field(default_factory=list)  # DTensors: (what, layout)

    def buffer(self, t: torch.Tensor) -> int:
        self.buffers.append(t.detach() if t.is_contiguous() else t.detach().contiguous())
        return len(self.buffers) - 1

    def whole(self, name: str, param: int, kind: str, t: torch.Tensor, key: str | None = None) -> None:
        """Pack tensor ``t`` whole: held by every rank, or a DTensor, of which this rank writes its
        local shard (a shard held by several ranks, ``Replicate``, split among them)."""
        if dtensor.is_dtensor(t):
            s = dtensor.sharding(t, f"save: {_what(kind, name, key)}")
            self.shard(name, param, kind, dtype_name(t.dtype), s, self.buffer(dtensor.local(t)), key)
            return
        e = self.packer.add(name, param, kind, t.shape, dtype_name(t.dtype), key)
        self.replicated.append(byte_ranges.IOItem(e.offset, e.nbytes, self.buffer(t), 0))

    def shard(self, name: str, param: int, kind: str, dtype: str, s: dl.Sharding, buf: int,
              key: str | None = None) -> None:
        """Pack a tensor laid out by ``s`` (from metadata alone) and plan this rank's writes of its
        shard from local buffer number ``buf``; the manifest records the layout by its rule."""
        e = self.packer.add(name, param, kind, s.shape, dtype, key, layout=s.rule())
        items = shard_runs(e, s, buf)
        index, count = s.replicas()
        self.own += byte_ranges.share_items(items, count, index, REPLICA_ALIGN) if count > 1 else items
        self.sharded.append((_what(kind, name, key), s))

    def table(self) -> list[tuple]:
        """What every rank must agree on: each entry's name, kind, key, shape, dtype and DTensor
        layout (its mesh's ranks by their digest: the table does not grow with the rank count)."""
        layouts = {what: s.key() for what, s in self.sharded}
        return [(e.name, e.kind, e.key, list(e.shape), e.dtype, layouts.get(_what(e.kind, e.name, e.key)))
                for e in self.packer.entries]

    def items(self, rank: int, size: int, block_size: int) -> list[byte_ranges.IOItem]:
        """What this rank writes: its share of the replicated items, and its own."""
        share = byte_ranges.share_items(sorted(self.replicated, key=lambda it: it.offset), size, rank, block_size)
        return share + self.own


@dataclass
class ReadPlan:
    """This rank's reads (items into destinations, converted from the file dtypes) and the steps
    that apply them once every check passed."""

    items: list[byte_ranges.IOItem] = field(default_factory=list)
    dests: list[torch.Tensor] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    apply: list[Callable[[], None]] = field(default_factory=list)
    sharded: list[tuple[str, dl.Sharding]] = field(default_factory=list)  # DTensors read: (what, layout)
    rank: int = 0
    # dests whose bytes another rank reads too and reports for the checksum check: a whole tensor
    # every rank reads (rank 0 reports it), a DTensor shard held by several ranks (its first holder)
    unchecked: set[int] = field(default_factory=set)

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
        if (s.replicas()[0] if s is not None else self.rank) != 0:
            self.unchecked.add(buf)
        self.items += [byte_ranges.IOItem(e.offset, e.nbytes, buf, 0)] if s is None else shard_runs(e, s, buf)
