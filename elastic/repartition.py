"""A survivor's new shard, point to point from the survivors holding the old shards: each rank
receives only the pieces of its new shard, never the full state."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

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
