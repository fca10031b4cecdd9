"""Where each rank's shard replica lives, and who provides every shard after a failure (pure).

A rank's replica goes to its buddy, ``stride`` ranks on (cyclically); ``stride(domains)`` picks
the shift that puts every buddy in another failure domain (host) than its rank where one does,
so that a node lost whole loses no shard."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def stride(domains: Sequence[int]) -> int:
    """The smallest shift ``s`` (1 <= s < len(domains)) such that no rank ``r`` shares its failure
    domain (``domains[r]``, e.g. a host id) with rank ``(r + s) % len(domains)``; when none
    separates them all, the one that separates most (1 when every rank shares one domain)."""
    d = np.asarray(domains)
    world = len(d)
    if world < 2 or (d == d[0]).all():
        return 1
    best, best_apart = 1, -1
    for s in range(1, world):
        apart = int((d != np.roll(d, -s)).sum())
        if apart == world:
            return s
        if apart > best_apart:
            best, best_apart = s, apart
    return best


def _check(rank: int, world: int, shift: int) -> None:
    if not 0 <= rank < world:
        raise ValueError(f"expected 0 <= rank < world, got rank={rank}, world={world}")
    if not 1 <= shift < max(world, 2):
        raise ValueError(f"expected 1 <= stride < world, got stride={shift}, world={world}")


def buddy(rank: int, world: int, shift: int = 1) -> int:
    """The rank holding ``rank``'s replica: ``shift`` ranks on, cyclically."""
    _check(rank, world, shift)
    return (rank + shift) % world


def ward(rank: int, world: int, shift: int = 1) -> int:
    """The rank whose replica ``rank`` holds: ``shift`` ranks back, cyclically."""
    _check(rank, world, shift)
    return (rank - shift) % world


def holders(world: int, survivors: Sequence[int], shift: int = 1) -> list[int | None]:
    """For every old rank's shard, the surviving old rank that holds it (its owner, else its
    buddy ``shift`` ranks on), or None when both are gone."""
    alive = set(int(s) for s in survivors)
    if not alive or not alive <= set(range(world)):
        raise ValueError(f"expected survivors within range({world}), got {sorted(alive)}")
    out: list[int | None] = []
    for s in range(world):
        if s in alive:
            out.append(s)
        elif world > 1 and buddy(s, world, shift) in alive:
            out.append(buddy(s, world, shift))
        else:
            out.append(None)
    return out


def lost_shards(world: int, survivors: Sequence[int], shift: int = 1) -> list[int]:
    """The old ranks whose shard no survivor holds."""
    return [s for s, h in enumerate(holders(world, survivors, shift)) if h is None]
