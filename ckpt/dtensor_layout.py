"""Where a DTensor's local shard lies in its full tensor, from metadata alone (pure, no MPI, no
process-group calls): per tensor dimension, the global index ranges a mesh coordinate holds, and
the runs of contiguous bytes of a row-major file tensor that make up that shard.

A layout is one list of ``(start, stop)`` ranges per tensor dimension, in the order of the local
tensor's elements: ``Shard(d)`` gives one range per dimension (a box: offsets and sizes); a
``_StridedShard`` (FSDP over TP) may give several. Placements follow torch's chunk semantics:
``Shard(d)`` over ``n`` ranks gives coordinate ``c`` the positions
``[min(c * ceil(L / n), L), min((c + 1) * ceil(L / n), L))`` of the current local length ``L``,
applied mesh dimension by mesh dimension, left to right.
"""
from __future__ import annotations

import itertools
import functools
import math
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

Ranges = list[tuple[int, int]]
Layout = list[Ranges]


class PlacementError(ValueError):
    """A placement that a checkpoint cannot store (``Partial``, unknown kinds)."""


@functools.cache
def _placement_classes() -> tuple[type, type, type]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return Replicate, Shard, _StridedShard


def placement_kind(p: Any) -> tuple[str, int | None, int | None]:
    """("shard", dim, None), ("strided", dim, split_factor) or ("replicate", None, None);
    ``Partial`` and other placements raise ``PlacementError``."""
    Replicate, Shard, _StridedShard = _placement_classes()
    if isinstance(p, _StridedShard):
        return "strided", int(p.dim), int(p._split_factor_int())
    if isinstance(p, Shard):
        return "shard", int(p.dim), None
    if isinstance(p, Replicate):
        return "replicate", None, None
    return type(p).__name__, None, None


def _take(ranges: Ranges, a: int, b: int) -> Ranges:
    """Local positions [a, b) of the index sequence ``ranges``, as global ranges."""
    out: Ranges = []
    pos = 0
    for lo, hi in ranges:
        n = hi - lo
        s, e = max(a, pos), min(b, pos + n)
        if s < e:
            out.append((lo + s - pos, lo + e - pos))
        pos += n
        if pos >= b:
            break
    return out


def _pick(ranges: Ranges, positions: Sequence[int]) -> Ranges:
    """Local ``positions`` (in order) of the index sequence ``ranges``, as coalesced ranges."""
    flat = np.concatenate([np.arange(lo, hi) for lo, hi in ranges]) if ranges else np.zeros(0, np.int64)
    out: Ranges = []
    for g in (int(flat[p]) for p in positions):
        if out and out[-1][1] == g:
            out[-1] = (out[-1][0], g + 1)
        else:
            out.append((g, g + 1))
    return out


def _length(ranges: Ranges) -> int:
    return sum(hi - lo for lo, hi in ranges)


def chunk(length: int, n: int, c: int) -> tuple[int, int]:
    """torch.chunk's piece ``c`` of ``n`` over ``length`` positions: (start, stop)."""
    full = -(-length // n) if length else 0
    start = min(full * c, length)
    return start, min(start + full, length)


def layout(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
           placements: Sequence[Any]) -> Layout:
    """The global index ranges, per tensor dimension, that mesh coordinate ``coord`` holds of a
    tensor of global ``shape`` placed by ``placements`` (one per mesh dimension)."""
    out: Layout = [[(0, int(s))] if s else [] for s in shape]
    for mdim, p in enumerate(placements):
        kind, dim, split = placement_kind(p)
        if kind == "replicate":
            continue
        if kind not in ("shard", "strided"):
            raise PlacementError(f"placement {p!r} cannot be saved")
        assert dim is not None
        if not 0 <= dim < len(shape):
            raise PlacementError(f"placement {p!r} shards dim {dim} of a {len(shape)}-d tensor")
        n, c = int(mesh_shape[mdim]), int(coord[mdim])
        cur = out[dim]
        if kind == "shard":
            out[dim] = _take(cur, *chunk(_length(cur), n, c))
        else:
            _size, positions = p._local_shard_size_and_offset(_length(cur), n, c, offset_mode=_all_offsets())
            out[dim] = _pick(cur, positions or [])
    return out


def _all_offsets() -> Any:
    from torch.distributed.tensor.placement_types import _StridedShardOffsetMode

    return _StridedShardOffsetMode.ALL


def local_shape(lay: Layout) -> tuple[int, ...]:
    return tuple(_length(r) for r in lay)


def volume(lay: Layout) -> int:
    return math.prod(local_shape(lay))


def runs(shape: Sequence[int], lay: Layout) -> list[tuple[int, int, int]]:
    """The shard as runs of the row-major full tensor: (element offset in the full tensor,
    element offset in the local tensor, element count), in local order."""
    shape = [int(s) for s in shape]
    if volume(lay) == 0:
        return []
    k = len(shape)
    j = k - 1
    while j >= 0 and lay[j] == [(0, shape[j])]:
        j -= 1
    if j < 0:
        return [(0, 0, math.prod(shape))]
    strides = [math.prod(shape[d + 1:]) for d in range(k)]
    inner = strides[j]
    base = np.zeros(1, dtype=np.int64)
    for d in range(j):
        idx = np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in lay[d]])
        base = np.add.outer(base, idx * strides[d]).reshape(-1)
    starts = np.array([lo for lo, _ in lay[j]], dtype=np.int64) * inner
    lengths = np.array([hi - lo for lo, hi in lay[j]], dtype=np.int64) * inner
    file_off = np.add.outer(base, starts).reshape(-1)
    lens = np.tile(lengths, len(base))
    local = np.concatenate([[0], np.cumsum(lens)[:-1]])
    return list(zip(file_off.tolist(), local.tolist(), lens.tolist()))


def as_json(lay: Layout) -> list[list[list[int]]]:
    """A layout as JSON: per dimension, [[start, stop], ...]."""
    return [[[lo, hi] for lo, hi in r] for r in lay]


def overlap(a: Layout, b: Layout) -> bool:
    """Whether two layouts share an element."""
    return all(any(lo1 < hi2 and lo2 < hi1 for lo1, hi1 in ra for lo2, hi2 in rb) for ra, rb in zip(a, b))


@dataclass(frozen=True)
class Sharding:
    """How a DTensor is laid out: its global shape, dtype name, mesh (shape, global ranks in
    coordinate order) and placements; ``coord`` is this rank's mesh coordinate (None: not in it)."""

    shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]
    placements: tuple[Any, ...]
    coord: tuple[int, ...] | None

    def describe(self) -> str:
        return f"mesh {list(self.mesh_shape)} placements ({', '.join(str(p) for p in self.placements)})"

    def key(self) -> tuple:
        """What must agree across ranks (the mesh's ranks by their digest)."""
        return (self.shape, self.mesh_shape, ranks_digest(self.mesh_ranks), tuple(str(p) for p in self.placements))

    def rule(self) -> dict[str, Any]:
        """The layout as the manifest records it: mesh shape and placements, from which every
        shard follows (``rule_layout``); its size does not depend on the mesh's size."""
        places = []
        for p in self.placements:
            kind, dim, split = placement_kind(p)
            places.append([kind] + ([] if dim is None else [dim]) + ([] if split is None else [split]))
        return {"mesh": list(self.mesh_shape), "placements": places}

    def shards(self) -> int:
        """How many distinct shards the layout has (the product of the sharded mesh dimensions)."""
        return math.prod(self.mesh_shape[i] for i in self.shard_dims())

    @functools.cached_property
    def _mine(self) -> Layout:
        if self.coord is None:
            return [[] for _ in self.shape]
        return layout(self.shape, self.mesh_shape, self.coord, self.placements)

    def mine(self) -> Layout:
        """This rank's layout (empty when the rank is not in the mesh); computed once."""
        return self._mine

    def shard_dims(self) -> list[int]:
        return [i for i, p in enumerate(self.placements) if placement_kind(p)[0] != "replicate"]

    def replicas(self) -> tuple[int, int]:
        """(this rank's index among the ranks holding the same shard, their count); computed once."""
        return self._replicas

    @functools.cached_property
    def _replicas(self) -> tuple[int, int]:
        rep = [i for i, p in enumerate(self.placements) if placement_kind(p)[0] == "replicate"]
        count = math.prod(self.mesh_shape[i] for i in rep)
        if self.coord is None:
            return 0, count
        index = 0
        for i in rep:
            index = index * self.mesh_shape[i] + self.coord[i]
        return index, count

    def boxes(self) -> list[Layout]:
        """Every distinct shard's layout (one per coordinate of the sharded mesh dims), non-empty ones."""
        dims = self.shard_dims()
        out = []
        for sub in itertools.product(*(range(self.mesh_shape[i]) for i in dims)):
            coord = [0] * len(self.mesh_shape)
            for i, c in zip(dims, sub):
                coord[i] = c
            lay = layout(self.shape, self.mesh_shape, coord, self.placements)
            if volume(lay):
                out.append(lay)
        return out


_DIGESTS: dict[int, tuple[tuple[int, ...], int]] = {}


def ranks_digest(ranks: tuple[int, ...]) -> int:
    """CRC-32 of a mesh's ranks, computed once per tuple object (every tensor on one mesh shares it)."""
    hit = _DIGESTS.get(id(ranks))
    if hit is not None and hit[0] is ranks:
        return hit[1]
    if len(_DIGESTS) > 64:
        _DIGESTS.clear()
    digest = zlib.crc32(np.asarray(ranks, dtype=np.int64).tobytes())
    _DIGESTS[id(ranks)] = (ranks, digest)
    return digest


def check_cover(shape: Sequence[int], boxes: Sequence[Layout]) -> None:
    """Raise unless ``boxes`` tile the tensor: disjoint, inside it, their volumes summing to its size."""
    total = sum(volume(b) for b in boxes)
    if total != math.prod(shape):
        raise PlacementError(f"the shards hold {total} elements of a tensor of shape {tuple(shape)}")
    for b in boxes:
        for rs, s in zip(b, shape):
            if any(lo < 0 or hi > s for lo, hi in rs):
                raise PlacementError(f"a shard {as_json(b)} lies outside shape {tuple(shape)}")
    for a, b in itertools.combinations(boxes if len(boxes) <= 16 else [], 2):
        if overlap(a, b):
            raise PlacementError(f"shards {as_json(a)} and {as_json(b)} overlap")
