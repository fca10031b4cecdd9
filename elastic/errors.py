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


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by ``state.check_host_updates()`` on every rank when slots were added to the job:
    ``elastic.run`` grows the job at that commit and calls ``train`` again (Horovod's name).
    ``skip_sync``: as Horovod's (nothing to synchronise: the state is the commit's)."""

    def __init__(self, message: str = "elastic: hosts were added to the job", skip_sync: bool = True) -> None:
        super().__init__(message)
        self.skip_sync = skip_sync
