"""The collectives as module functions on the world communicator (after mpicomm.init())."""
from __future__ import annotations

import functools

from . import communicator as _c

NAMES = ("all_reduce", "reduce", "reduce_scatter_tensor", "broadcast", "all_gather_into_tensor",
         "all_gather", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
         "barrier", "split")


def _forward(name: str):
    method = getattr(_c.Communicator, name)

    @functools.wraps(method)
    def call(*args, **kwargs):
        world = _c._world
        if world is None:
            world = _c.get_world()
        return method(world, *args, **kwargs)

    return call


globals().update({name: _forward(name) for name in NAMES})


def get_rank() -> int:
    """Rank of this process in the world communicator."""
    return _c.get_world().rank


def get_world_size() -> int:
    """Number of ranks in the world communicator."""
    return _c.get_world().size
