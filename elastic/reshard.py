"""A ZeroOptimizer group's shards re-partitioned over another world size (pure, no MPI)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


def is_elementwise(value: Any, master: torch.Tensor) -> bool:
    """Whether an optimizer state entry holds one value per master element (``exp_avg``)."""
    return isinstance(value, torch.Tensor) and value.shape == master.shape and value.dim() == 1


def split_state(state: dict[str, Any], master: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a shard's optimizer state into per-element tensors and the rest (``step``)."""
    elementwise = {k: v for k, v in state.items() if is_elementwise(v, master)}
    other = {k: v for k, v in state.items() if k not in elementwise}
    return elementwise, other


@dataclass(frozen=True)
class Piece:
    """``length`` elements at ``src_local`` of old rank ``src``'s local shard that land at
    ``dst_local`` of new rank ``dst``'s local shard."""

    src: int
    dst: int
    src_local: int
    dst_local: int
    length: int


def _same(old: Any, new: Any) -> None:
    if old.numels != new.numels or old.param_ids != new.param_ids or old.stage != new.stage:
        raise ValueError(f"expected layouts of the same parameters and stage, got {old!r} and {new!r}")


def _matches(here: Any, there: Any, rank: int) -> list[tuple[int, int, int, int]]:
    """(rank of ``there``, local start in ``rank``'s shard of ``here``, local start in that rank's
    shard, length) of every run ``rank``'s shard under layout ``here`` shares with a shard of
    ``there``, in ``rank``'s local order; found from ``there``'s arithmetic (``locate``)."""
    _same(here, there)
    index = {pid: i for i, pid in enumerate(here.param_ids)}
    return [(other, seg.local + s.start - seg.start, s.local, s.length)
            for seg in here.segments(rank) for other, s in there.locate(index[seg.param], seg.start, seg.length)]


def pieces_to(old: Any, new: Any, dst: int) -> list[Piece]:
    """What lands in new rank ``dst``'s shard when a group laid out as ``old`` (a
    ``zero.ShardLayout``) is laid out as ``new`` (the same parameters over another world size),
    by ``dst_local``; found from the layouts' arithmetic, without the other ranks' runs. Padding
    is in no piece."""
    return [Piece(src, dst, there, here, n) for src, here, there, n in _matches(new, old, dst)]


def pieces_from(old: Any, new: Any, src: int) -> list[Piece]:
    """What leaves old rank ``src``'s shard (the same pieces as ``pieces_to`` gives the
    receivers), by ``dst`` and ``dst_local``."""
    out = [Piece(src, dst, here, there, n) for dst, here, there, n in _matches(old, new, src)]
    out.sort(key=lambda p: (p.dst, p.dst_local))
    return out


def overlaps(old: Sequence[tuple[int, int, int, int]], new: Sequence[tuple[int, int, int, int]]) -> list[Piece]:
    """The pieces shared by two splits of one range: ``old`` and ``new`` list its runs as
    (start in the range, length, rank, start in the rank's buffer), each run of a split in one
    rank's buffer, no two runs of a split overlapping (gaps, e.g. what no rank holds, are allowed)."""
    a, b = sorted(old), sorted(new)
    out: list[Piece] = []
    i = j = 0
    while i < len(a) and j < len(b):
        a_lo, a_n, src, src_local = a[i]
        b_lo, b_n, dst, dst_local = b[j]
        lo, hi = max(a_lo, b_lo), min(a_lo + a_n, b_lo + b_n)
        if lo < hi:
            out.append(Piece(src, dst, src_local + lo - a_lo, dst_local + lo - b_lo, hi - lo))
        if a_lo + a_n <= b_lo + b_n:
            i += 1
        else:
            j += 1
    return out
