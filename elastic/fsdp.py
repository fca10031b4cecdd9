"""An FSDP2 (``fully_shard``) parameter's or optimizer state's new local shard, filled from the
committed local shards of the old world (pure, no MPI): the same placement rules ckpt uses for
N->M (``ckpt.dtensor_layout``: torch's chunk semantics, uneven last shards included)."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ckpt import dtensor_layout as dl


def _runs(shape: Sequence[int], world: int, rank: int, placements: Sequence[Any]) -> list[tuple[int, int, int]]:
    return sorted(dl.runs(shape, dl.layout(shape, (world,), (rank,), placements)))


def local_shape(shape: Sequence[int], world: int, rank: int, placements: Sequence[Any]) -> tuple[int, ...]:
    """The local shard shape of ``rank`` of a tensor of global ``shape`` on a 1-D mesh of ``world``."""
    return dl.local_shape(dl.layout(shape, (world,), (rank,), placements))


def new_shard(shape: Sequence[int], placements: Sequence[Any], old_rows: Sequence[torch.Tensor],
              new_world: int, new_rank: int) -> torch.Tensor:
    """The local shard of ``new_rank`` on a 1-D mesh of ``new_world`` ranks, built from
    ``old_rows[r]``: the local shard old rank ``r`` held on a 1-D mesh of ``len(old_rows)`` ranks
    (``placements`` on both meshes, e.g. ``(Shard(0),)``)."""
    shape = tuple(int(s) for s in shape)
    old_world = len(old_rows)
    if old_world < 1 or not 0 <= new_rank < new_world:
        raise ValueError(f"expected >= 1 old rows and 0 <= new_rank < new_world, got {old_world} rows, "
                         f"new_rank={new_rank}, new_world={new_world}")
    want = local_shape(shape, new_world, new_rank, placements)
    out = torch.empty(want, dtype=old_rows[0].dtype, device=old_rows[0].device)
    flat = out.reshape(-1)
    mine = _runs(shape, new_world, new_rank, placements)
    filled = 0
    for r, row in enumerate(old_rows):
        expect = local_shape(shape, old_world, r, placements)
        if tuple(row.shape) != expect:
            raise ValueError(f"old rank {r}: expected a local shard of shape {list(expect)} of global shape "
                             f"{list(shape)} over {old_world} ranks, got {list(row.shape)}")
        src = row.reshape(-1)
        theirs = _runs(shape, old_world, r, placements)
        i = j = 0
        while i < len(mine) and j < len(theirs):  # both sorted by full-tensor offset
            fa, la, na = mine[i]
            fb, lb, nb = theirs[j]
            lo, hi = max(fa, fb), min(fa + na, fb + nb)
            if lo < hi:
                flat[la + lo - fa:la + hi - fa].copy_(src[lb + lo - fb:lb + hi - fb])
                filled += hi - lo
            if fa + na <= fb + nb:
                i += 1
            else:
                j += 1
    if filled != flat.numel():
        raise ValueError(f"the old shards cover {filled} of the {flat.numel()} elements of new rank "
                         f"{new_rank}'s shard of global shape {list(shape)}: are the placements replicated?")
    return out
