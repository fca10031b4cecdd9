"""A survivor's new shard, point to point from the survivors holding the old shards: each rank
receives only the pieces of its new shard, never the full state."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from . import reshard, values
from .reshard import Piece

#: Tags of the exchange, one per state tensor kind (master, then the optimizer's elementwise state).
_TAG = 29229


def exchange(comm: Any, incoming: Iterable[Piece], outgoing: Iterable[Piece],
             rows: dict[int, Sequence[torch.Tensor]], holder: Sequence[int], like: Sequence[torch.Tensor],
             numel: int) -> list[torch.Tensor]:
    """This rank's new shard, one ``numel``-element tensor per kind of ``like`` (its dtype and
    device), padding zero. ``incoming``: the pieces of this rank's new shard; ``outgoing``: the
    pieces of the old shards this rank holds (``rows[s]``, one tensor per kind, for old rank
    ``s``); old rank ``s``'s shard is sent by rank ``holder[s]`` of ``comm``. Collective over
    ``comm``: every rank calls it, with the pieces of one plan (``reshard.pieces_to`` /
    ``pieces_from``, ``fsdp.plan``)."""
    me = int(comm.rank)
    out = [torch.zeros(numel, dtype=t.dtype, device=t.device) for t in like]
    recvs: dict[int, list[Piece]] = {}
    for p in incoming:
        if holder[p.src] == me:
            for k, o in enumerate(out):
                o[p.dst_local:p.dst_local + p.length].copy_(_cut(rows[p.src][k], p.src_local, p.length))
        else:
            recvs.setdefault(holder[p.src], []).append(p)
    sends: dict[int, list[Piece]] = {}
    for p in outgoing:
        if p.dst != me:
            sends.setdefault(p.dst, []).append(p)
    works, unpack = [], []
    for src, ps in sorted(recvs.items()):
        ps.sort(key=lambda p: p.dst_local)          # the order the sender packs them in
        total = sum(p.length for p in ps)
        for k, o in enumerate(out):
            if len(ps) == 1:       # one run: straight into its place
                buf = o[ps[0].dst_local:ps[0].dst_local + total]
            else:
                buf = torch.empty(total, dtype=o.dtype, device=o.device)
                unpack.append((buf, o, ps))
            works.append(comm.irecv(buf, src, tag=_TAG + k))
    for dst, ps in sorted(sends.items()):
        ps.sort(key=lambda p: p.dst_local)
        for k in range(len(out)):
            runs = [_cut(rows[p.src][k], p.src_local, p.length) for p in ps]
            works.append(comm.isend(runs[0] if len(runs) == 1 else torch.cat(runs), dst, tag=_TAG + k))
    for w in works:
        w.wait()
    for buf, o, ps in unpack:
        at = 0
        for p in ps:
            o[p.dst_local:p.dst_local + p.length].copy_(buf[at:at + p.length])
            at += p.length
    return out


def _cut(row: torch.Tensor, lo: int, length: int) -> torch.Tensor:
    return row.reshape(-1)[lo:lo + length]


@torch.no_grad()
def rebuild_shards(state: Any, c: Any, new_comm: Any, survivors: Sequence[int], old_world: int) -> None:
    """Re-partition the ZeroOptimizer shards of commit ``c`` (made over ``old_world`` ranks) over
    ``new_comm``, whose rank ``i`` was old rank ``survivors[i]`` (-1: a rank that joined, which
    holds nothing), and rebind the optimizer to it. The old layouts come from ``old_world``, not
    from the optimizer: an earlier attempt of the same recovery may have rebound it already."""
    from . import replicas
    from .errors import ShardsLostError

    olds = [s for s in survivors if s >= 0]
    held = replicas.holders(old_world, olds, c.stride)
    lost = [s for s, h in enumerate(held) if h is None]
    if lost:
        raise ShardsLostError(
            f"elastic: the ZeroOptimizer shards of old ranks {lost} are lost (each rank and its buddy, "
            f"{c.stride} on, both failed; survivors: old ranks {olds}); no checkpoint_dir to fall back to",
            lost)
    me = survivors[int(new_comm.rank)]
    wards = [s for s, h in enumerate(held) if h == me and s != me]
    ward = c.ward_pieces() if wards else c.ward
    if wards and ward is None:
        raise ShardsLostError(
            f"elastic: the ZeroOptimizer shard of old rank {wards[0]} is lost: its copy in shared memory no "
            f"longer holds commit {c.gen} (that rank was writing another commit)", wards)
    senders = [list(survivors).index(h) for h in held]        # the new rank that sends old shard s
    opt = state.optimizer
    new_world, new_rank = int(new_comm.size), int(new_comm.rank)
    local, i = [], 0
    for gi, (old, layout) in enumerate(zip(opt.layouts_for(old_world), opt.layouts_for(new_world))):
        kinds = 1 + len(c.keys[gi])                     # the master, then the elementwise state
        rows = {s: (c.own if s == me else ward)[i:i + kinds] for s, h in enumerate(held) if h == me}
        incoming = reshard.pieces_to(old, layout, new_rank)
        outgoing = [p for s in rows for p in reshard.pieces_from(old, layout, s)]
        master, *rest = exchange(new_comm, incoming, outgoing, rows, senders, c.own[i:i + kinds], layout.local_numel)
        local.append((master, dict(zip(c.keys[gi], rest)), values.restore(None, ("value", c.other[gi]))))
        i += kinds
    opt.rebind(new_comm, local)


@torch.no_grad()
def shards_from_params(state: Any, new_comm: Any) -> None:
    """Rebind the ZeroOptimizer over ``new_comm`` with fp32 masters taken from the model's
    weights and no optimizer state: its shards before its first update (every rank holds
    those weights whole)."""
    opt = state.optimizer
    new_world, new_rank = int(new_comm.size), int(new_comm.rank)
    local = []
    for g, layout in zip(opt.groups, opt.layouts_for(new_world)):
        master = torch.zeros(layout.local_numel, dtype=torch.float32, device=g.master.device)
        for s in layout.segments(new_rank):
            master[s.local:s.local + s.length].copy_(g.params[s.param].detach().reshape(-1)[s.start:s.start + s.length])
        local.append((master, {}, {}))
    opt.rebind(new_comm, local)
