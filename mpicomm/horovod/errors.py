"""Horovod's exception names."""
from __future__ import annotations


class HorovodInternalError(RuntimeError):
    """A collective failed (in elastic training: a rank was lost; the state is restored)."""


def hosts_updated_interrupt():
    """elastic.HostsUpdatedInterrupt when the elastic package has it, else our own class."""
    try:
        import elastic
        cls = getattr(elastic, "HostsUpdatedInterrupt", None)
    except ImportError:
        cls = None
    return cls or _HostsUpdatedInterrupt


class _HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed: leave the step; the job re-forms at the new size."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the hosts of the job changed")
        self.skip_sync = skip_sync
