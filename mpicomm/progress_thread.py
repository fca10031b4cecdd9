"""One progress thread that completes pending non-blocking operations without the caller polling.

Items are objects with ``_poll(now: float) -> bool`` (test once; True when finished, results
and futures already delivered). The thread tests every pending item, backing off from a few
microseconds to :data:`MAX_DELAY` while nothing completes, and sleeps on a condition when
nothing is pending. It calls MPI concurrently with the application's thread, so it only runs
when MPI was initialised with ``MPI_THREAD_MULTIPLE`` (mpi4py's default); :func:`enabled` says
whether it does.
"""
from __future__ import annotations

import logging
import threading
import time

from mpi4py import MPI

MIN_DELAY = 5e-6
MAX_DELAY = 2e-4
_log = logging.getLogger("mpicomm")


class _Engine:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._items: list = []
        self._thread: threading.Thread | None = None

    def add(self, item) -> None:
        with self._cv:
            self._items.append(item)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="mpicomm-progress",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def pending(self) -> int:
        with self._cv:
            return len(self._items)

    def _run(self) -> None:
        delay = MIN_DELAY
        while True:
            with self._cv:
                while not self._items:
                    self._cv.wait()
                    delay = MIN_DELAY
                items = list(self._items)
            now = time.monotonic()
            finished = []
            for item in items:
                try:
                    if item._poll(now):
                        finished.append(item)
                except BaseException:  # noqa: BLE001 - an item reports its own errors
                    _log.exception("mpicomm progress thread: polling %r failed", item)
                    finished.append(item)
            with self._cv:
                for item in finished:
                    self._items.remove(item)
                if finished:
                    delay = MIN_DELAY
                elif self._items:
                    self._cv.wait(delay)
                    delay = min(2 * delay, MAX_DELAY)


_engine = _Engine()
_enabled: bool | None = None


def enabled() -> bool:
    """Whether the progress thread may run: MPI was initialised with MPI_THREAD_MULTIPLE."""
    global _enabled
    if _enabled is None:
        _enabled = MPI.Query_thread() == MPI.THREAD_MULTIPLE
    return _enabled


def add(item) -> None:
    """Hand ``item`` to the progress thread (only when :func:`enabled`)."""
    if not enabled():
        raise RuntimeError("mpicomm progress thread needs MPI_THREAD_MULTIPLE (MPI was "
                           f"initialised with thread level {MPI.Query_thread()})")
    _engine.add(item)


def pending() -> int:
    """How many items the progress thread is still completing."""
    return _engine.pending()
