"""One thread that keeps every deadline of the process groups' calls.

Every process-group call is watched from launch to completion: a blocking call (its thread
inside MPI's blocking primitive, which cannot be interrupted) as NCCL's watchdog does, an async
work the same way. A :class:`Deadline` has an optional notice time (half the timeout: the call
is published in the store for the peers' timeout reports) and a due time (the call times out).
The thread sleeps until the next of those times; it never holds its lock while calling back.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

_log = logging.getLogger("mpicomm")


@dataclass(eq=False)
class Deadline:
    """``on_due()`` runs at monotonic time ``due`` unless unwatched before; ``on_notice()`` at
    ``notice`` (``noticed`` then is True)."""

    due: float
    on_due: Callable[[], None]
    notice: float = math.inf
    on_notice: Callable[[], None] | None = None
    noticed: bool = False

    def next_time(self) -> float:
        return self.due if self.noticed or self.on_notice is None else min(self.notice, self.due)


class _Deadlines:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._entries: dict[int, Deadline] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._wakes_at = -math.inf  # when the sleeping thread wakes next (-inf: it is awake)

    def watch(self, deadline: Deadline) -> int:
        """Start keeping ``deadline``; the key given back unwatches it."""
        key = next(self._ids)
        with self._cv:
            self._entries[key] = deadline
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="mpicomm-deadlines",
                                                daemon=True)
                self._thread.start()
            elif deadline.next_time() < self._wakes_at:
                self._cv.notify()
        return key

    def unwatch(self, key: int) -> Deadline | None:
        """Stop keeping a deadline; None when it already fell due (its ``on_due`` ran or runs)."""
        with self._cv:
            return self._entries.pop(key, None)

    def _run(self) -> None:
        while True:
            with self._cv:
                now = time.monotonic()
                due, notices, wake = [], [], math.inf
                for key, d in list(self._entries.items()):
                    if now >= d.due:
                        del self._entries[key]
                        due.append(d)
                    elif not d.noticed and d.on_notice is not None and now >= d.notice:
                        d.noticed = True
                        notices.append(d)
                    else:
                        wake = min(wake, d.next_time())
                if not due and not notices:
                    self._wakes_at = wake
                    self._cv.wait(None if wake == math.inf else wake - now)
                    self._wakes_at = -math.inf
                    continue
            for d, fn in [(d, d.on_notice) for d in notices] + [(d, d.on_due) for d in due]:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - one deadline's failure must not stop the others
                    _log.exception("mpicomm deadline thread: %r failed", fn)


_deadlines = _Deadlines()
watch = _deadlines.watch
unwatch = _deadlines.unwatch
