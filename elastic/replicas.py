"""Where each rank's shard replica lives, and who provides every shard after a failure (pure)."""
from __future__ import annotations

from typing import Sequence


def buddy(rank: int, world: int) -> int:
    """The rank holding ``rank``'s replica: the next rank, cyclically."""
    if not 0 <= rank < world:
        raise ValueError(f"expected 0 <= rank < world, got rank={rank}, world={world}")
    return (rank + 1) % world


def ward(rank: int, world: int) -> int:
    """The rank whose replica ``rank`` holds: the previous rank, cyclically."""
    if not 0 <= rank < world:
        raise ValueError(f"expected 0 <= rank < world, got rank={rank}, world={world}")
    return (rank - 1) % world


def holders(world: int, survivors: Sequence[int]) -> list[int | None]:
    """For every old rank's shard, the surviving old rank that holds it (its owner, else its
    buddy), or None when both are gone."""
    alive = set(int(s) for s in survivors)
    if not alive or not alive <= set(range(world)):
        raise ValueError(f"expected survivors within range({world}), got {sorted(alive)}")
    out: list[int | None] = []
    for s in range(world):
        if s in alive:
            out.append(s)
        elif world > 1 and buddy(s, world) in alive:
            out.append(buddy(s, world))
        else:
            out.append(None)
    return out


def lost_shards(world: int, survivors: Sequence[int]) -> list[int]:
    """The old ranks whose shard no survivor holds."""
    return [s for s, h in enumerate(holders(world, survivors)) if h is None]
