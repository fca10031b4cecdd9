"""What hvd.init() set up (the job's communicator, process sets), shared by the hvd modules."""
from __future__ import annotations

import mpicomm


class _State:
    world: "mpicomm.Communicator | None" = None   # the job's communicator (hvd.init's comm)
    cross: "mpicomm.Communicator | None" = None
    homogeneous: bool = True
    sets: dict = {}                                # process set id -> ProcessSet
    next_set_id: int = 1


state = _State()


class NotInitializedError(ValueError):
    """A Horovod call before hvd.init() (Horovod raises ValueError)."""


def _need():
    if state.world is None:
        raise NotInitializedError("Horovod has not been initialized; use hvd.init().")
    return state.world
