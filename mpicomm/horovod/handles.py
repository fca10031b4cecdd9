"""Handles of asynchronous calls: ``poll``, ``synchronize``, and the handle table."""
from __future__ import annotations

import itertools
from typing import Callable

from .basics import engines, wait
from .engine import Op


class _Entry:
    __slots__ = ("ops", "build")

    def __init__(self, ops: list[Op], build: Callable[[list[Op]], object]) -> None:
        self.ops, self.build = ops, build


_table: dict[int, _Entry] = {}
_ids = itertools.count(1)


def new_handle(ops: list[Op], build: Callable[[list[Op]], object]) -> int:
    h = next(_ids)
    _table[h] = _Entry(ops, build)
    return h


def _entry(handle: int, call: str) -> _Entry:
    try:
        return _table[handle]
    except (KeyError, TypeError):
        raise ValueError(f"{call}: {handle!r} is not a handle of a call in flight (already "
                         "synchronized, or not from an *_async call)") from None


def poll(handle: int) -> bool:
    """True when the call of ``handle`` has completed (``synchronize`` then returns at once)."""
    entry = _entry(handle, "poll")
    if not all(op.done for op in entry.ops):
        for e in engines():
            if e.pending():
                e.progress()
    return all(op.done for op in entry.ops)


def synchronize(handle: int):
    """Wait for the call of ``handle`` and return its output (raises the call's error)."""
    entry = _entry(handle, "synchronize")
    try:
        wait(entry.ops)
    finally:
        if all(op.done for op in entry.ops):
            _table.pop(handle, None)
    for op in entry.ops:
        if op.error is not None:
            raise op.error
    return entry.build(entry.ops)


def run(ops: list[Op], build: Callable[[list[Op]], object]):
    """Submit-and-wait for the blocking calls."""
    return synchronize(new_handle(ops, build))
