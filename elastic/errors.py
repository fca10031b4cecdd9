"""The errors elastic raises when a failure cannot be recovered from."""
from __future__ import annotations


class ElasticError(RuntimeError):
    """A recovery that cannot go on; raised on every survivor, so the job ends."""


class WorldTooSmallError(ElasticError):
    """Fewer survivors than ``elastic.run(min_world_size=...)`` asks for."""


class ShardsLostError(ElasticError):
    """A sharded state's shard and its buddy replica were both lost (``.lost``: the old ranks)."""

    def __init__(self, message: str, lost: list[int]) -> None:
        super().__init__(message)
        self.lost = lost


class ResetCallbackError(ElasticError):
    """A reset callback raised after a recovery."""
