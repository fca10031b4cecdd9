"""ZeRO partition math: which slice of which parameter each rank owns (pure, no MPI)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

#: the stages ZeroOptimizer runs (1: optimizer state sharded; 2: gradients too)
STAGES = (1, 2)
#: the layouts ShardLayout knows: 1 flat; 2 and 3 each parameter split on its own (ZeroOptimizer's
#: stage 2, and DeepSpeed's ZeRO-3 partition, read when importing its checkpoints)
LAYOUT_STAGES = (1, 2, 3)


@dataclass(frozen=True)
class Segment:
    """A run of ``length`` elements of parameter ``param`` starting at element ``start``,
    stored in a rank's local flat shard at element ``local``."""

    param: int
    start: int
    local: int
    length: int


def ceil_div(a: int, b: int) -> int:
    """Return ceil(a / b) for non-negative a and positive b."""
    return -(-a // b)


def split_evenly(total: int, parts: int, index: int, align: int = 1) -> tuple[int, int]:
    """Return [start, stop) of part ``index`` when ``total`` units are split into ``parts``
    nearly equal pieces whose boundaries fall on multiples of ``align`` (except ``total``)."""
    if parts <= 0 or not 0 <= index < parts:
        raise ValueError(f"expected 0 <= index < parts, got index={index}, parts={parts}")
    if align <= 0:
        raise ValueError(f"expected align >= 1, got {align}")
    units = ceil_div(total, align)

    def bound(i: int) -> int:
        return min(total, (units * i // parts) * align)

    return bound(index), bound(index + 1)


class ShardLayout:
    """Layout of one parameter group's fp32 masters over ``world_size`` ranks.

    Stage 1: the group's parameters are flattened one after another, padded to a multiple
    of ``world_size`` and split evenly; rank r owns elements [r*L, (r+1)*L) of that buffer.
    Stages 2 and 3: every parameter is split on its own into ``ceil(numel / world_size)``-element
    pieces; rank r's shard is its piece of each parameter in turn, each padded to full size
    (ZeroOptimizer's stage 2 layout, and DeepSpeed ZeRO-3's partition).
    Either way every rank's local shard has ``local_numel`` elements and the padded full
    buffer, viewed as ``(world_size, local_numel)``, has rank r's shard in row r.
    """

    def __init__(self, numels: Sequence[int], world_size: int, stage: int,
                 param_ids: Sequence[int] | None = None) -> None:
        if stage not in LAYOUT_STAGES:
            raise ValueError(f"expected stage in {LAYOUT_STAGES}, got {stage!r}")
        if world_size < 1:
            raise ValueError(f"expected world_size >= 1, got {world_size}")
        if any(n < 0 for n in numels):
            raise ValueError(f"expected non-negative numels, got {list(numels)}")
        self.numels = tuple(int(n) for n in numels)
        self.world_size = int(world_size)
        self.stage = int(stage)
        self.per_param = self.stage >= 2
        ids = range(len(self.numels)) if param_ids is None else param_ids
        if len(ids) != len(self.numels):
            raise ValueError(f"expected {len(self.numels)} param_ids, got {len(ids)}")
        self.param_ids = tuple(int(i) for i in ids)
        self.total_numel = sum(self.numels)
        if not self.per_param:
            self._offsets = [0]
            for n in self.numels:
                self._offsets.append(self._offsets[-1] + n)
            self.local_numel = ceil_div(self.total_numel, self.world_size)
        else:
            self.pieces = tuple(ceil_div(n, self.world_size) for n in self.numels)
            self._local_offsets = [0]
            for piece in self.pieces:
                self._local_offsets.append(self._local_offsets[-1] + piece)
            self.local_numel = self._local_offsets[-1]
        self._cache: dict[int, tuple[Segment, ...]] = {}

    @property
    def padded_numel(self) -> int:
        """Elements in the padded full buffer (``world_size * local_numel``)."""
        return self.world_size * self.local_numel

    def segments(self, rank: int) -> tuple[Segment, ...]:
        """The real (unpadded) data in ``rank``'s shard, in local order; ``param`` is the
        parameter's id from ``param_ids``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"expected 0 <= rank < {self.world_size}, got {rank}")
        if rank not in self._cache:
            self._cache[rank] = tuple(self._per_param(rank) if self.per_param else self._flat(rank))
        return self._cache[rank]

    def _flat(self, rank: int) -> list[Segment]:
        lo = rank * self.local_numel
        hi = min(lo + self.local_numel, self.total_numel)
        out: list[Segment] = []
        if lo >= hi:
            return out
        i = bisect.bisect_right(self._offsets, lo) - 1
        pos = lo
        while pos < hi:
            p_lo, p_hi = self._offsets[i], self._offsets[i + 1]
            take = min(hi, p_hi) - pos
            if take > 0:
                out.append(Segment(self.param_ids[i], pos - p_lo, pos - lo, take))
                pos += take
            i += 1
        return out

    def _per_param(self, rank: int) -> list[Segment]:
        out: list[Segment] = []
        for i, (n, piece) in enumerate(zip(self.numels, self.pieces)):
            start = rank * piece
            length = min(n, start + piece) - start
            if length > 0:
                out.append(Segment(self.param_ids[i], start, self._local_offsets[i], length))
        return out

    def locate(self, index: int, start: int, length: int) -> list[tuple[int, Segment]]:
        """Where elements [start, start + length) of the parameter at position ``index`` of
        ``numels`` live: (rank, its Segment there) pairs in element order."""
        if not 0 <= index < len(self.numels):
            raise ValueError(f"expected 0 <= index < {len(self.numels)}, got {index}")
        end = start + length
        if start < 0 or length < 0 or end > self.numels[index]:
            raise ValueError(f"expected a range within the {self.numels[index]} elements of parameter {index}, "
                             f"got start={start}, length={length}")
        out: list[tuple[int, Segment]] = []
        if length == 0:
            return out
        pid = self.param_ids[index]
        if self.per_param:
            piece, base = self.pieces[index], self._local_offsets[index]
            for r in range(start // piece, (end - 1) // piece + 1):
                lo, hi = max(start, r * piece), min(end, (r + 1) * piece)
                out.append((r, Segment(pid, lo, base + lo - r * piece, hi - lo)))
        else:
            base, size = self._offsets[index], self.local_numel
            for r in range((base + start) // size, (base + end - 1) // size + 1):
                lo, hi = max(base + start, r * size), min(base + end, (r + 1) * size)
                out.append((r, Segment(pid, lo - base, lo - r * size, hi - lo)))
        return out

    def all_segments(self) -> list[tuple[int, Segment]]:
        """Every rank's segments as (rank, segment) pairs."""
        return [(r, s) for r in range(self.world_size) for s in self.segments(r)]

    def __repr__(self) -> str:
        return (f"ShardLayout(stage={self.stage}, world_size={self.world_size}, "
                f"params={len(self.numels)}, total={self.total_numel}, local={self.local_numel})")
