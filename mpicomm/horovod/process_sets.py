"""Process sets: collectives over a subset of the ranks (Horovod's ProcessSet API)."""
from __future__ import annotations

from typing import Sequence

from ._state import _need, state
from .engine import Engine


class ProcessSet:
    """A set of ranks for collectives (``process_set=`` of every call). Made by
    :func:`add_process_set` (or ``hvd.init(process_sets=[...])``), released by
    :func:`remove_process_set`."""

    def __init__(self, ranks_or_comm: Sequence[int]) -> None:
        self.ranks = sorted(int(r) for r in ranks_or_comm) if ranks_or_comm is not None else None
        self.process_set_id: int | None = None
        self._comm = None
        self._engine: Engine | None = None

    def _attach(self, set_id: int, ranks: list[int], comm) -> None:
        self.process_set_id, self.ranks, self._comm = set_id, ranks, comm
        self._engine = Engine(comm) if comm is not None else None

    def _detach(self) -> None:
        if self._engine is not None:
            self._engine.free()
        if self._comm is not None and self.process_set_id != 0:
            self._comm.free()
        self._engine = self._comm = None
        self.process_set_id = None

    def _live(self, call: str) -> Engine:
        _need()
        if self.process_set_id is None:
            raise ValueError(f"{call}: the process set {self.ranks} is not registered (removed, "
                             "or made before hvd.init() without add_process_set)")
        if self._engine is None:
            raise ValueError(f"{call}: this rank is not in the process set {self.ranks}")
        return self._engine

    def size(self) -> int | None:
        return None if self.ranks is None else len(self.ranks)

    def rank(self) -> int | None:
        """This rank's rank within the set (None if not a member)."""
        return None if self._comm is None else self._comm.rank

    def included(self) -> bool:
        _need()
        return self._comm is not None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet(None)


def _register(ps: ProcessSet) -> ProcessSet:
    world = _need()
    ranks = ps.ranks
    bad = [r for r in ranks if not 0 <= r < world.size]
    if not ranks or bad or len(set(ranks)) != len(ranks):
        raise ValueError(f"add_process_set: expected distinct ranks in [0, {world.size}), got {ranks}")
    everyone = world.mpi_comm.allgather(ranks)
    if any(o != ranks for o in everyone):
        raise ValueError(f"add_process_set: the ranks passed differ across ranks ({everyone}); "
                         "every rank must add the same set, in the same order")
    for other in state.sets.values():
        if other.ranks == ranks:
            raise ValueError(f"add_process_set: a process set with ranks {ranks} already exists "
                             f"(id {other.process_set_id})")
    comm = world.split(0 if world.rank in ranks else None, key=world.rank)
    ps._attach(state.next_set_id, ranks, comm)
    state.sets[state.next_set_id] = ps
    state.next_set_id += 1
    return ps


def add_process_set(process_set: "ProcessSet | Sequence[int]") -> ProcessSet:
    """Register a process set (collective over every rank, all passing the same ranks)."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"add_process_set: {ps} is already registered")
    return _register(ps)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Release a process set (collective over every rank); False if it was not registered."""
    world = _need()
    if process_set is global_process_set:
        raise ValueError("remove_process_set: the global process set cannot be removed")
    if process_set.process_set_id not in state.sets:
        return False
    if process_set._engine is not None:
        process_set._engine.drain()
    world.mpi_comm.Barrier()
    del state.sets[process_set.process_set_id]
    process_set._detach()
    return True
