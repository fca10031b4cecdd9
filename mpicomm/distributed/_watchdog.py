"""Deadlines of blocking process-group calls: past one, report and abort the MPI job.

A blocking call runs MPI's blocking primitive (as fast as mpicomm's own blocking call) on the
caller's thread, which cannot be interrupted; this thread watches its deadline instead, as
NCCL's watchdog does. Used only under MPI_THREAD_MULTIPLE (the abort comes from this thread).
"""
from __future__ import annotations

import itertools
import threading
import time

_TICK = 0.05  # seconds between checks while a call is watched


class _Entry:
    __slots__ = ("pg", "call", "seq", "described", "timeout", "start", "published")

    def __init__(self, pg, call, seq, described, timeout) -> None:
        self.pg, self.call, self.seq, self.described = pg, call, seq, described
        self.timeout = timeout
        self.start = time.monotonic()
        self.published = False


class _Watchdog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def start(self, pg, call: str, seq: int, described, timeout) -> int:
        key = next(self._ids)
        with self._lock:
            self._entries[key] = _Entry(pg, call, seq, described, timeout)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mpicomm-watchdog",
                                                daemon=True)
                self._thread.start()
        if not self._wake.is_set():  # the thread sleeps until a call is watched
            self._wake.set()
        return key

    def finish(self, key: int) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is not None and entry.published:
            entry.pg._publish_waiting(None, None)

    def _run(self) -> None:
        from ._work import expire

        while True:
            with self._lock:
                entries = list(self._entries.items())
            if not entries:
                self._wake.clear()
                with self._lock:
                    idle = not self._entries
                if idle:
                    self._wake.wait()
                continue
            now = time.monotonic()
            for key, e in entries:
                limit = e.timeout.total_seconds()
                if now - e.start >= limit:
                    with self._lock:
                        if self._entries.pop(key, None) is None:
                            continue  # finished meanwhile
                    expire(e.pg, e.call, e.seq, e.described, e.timeout, now - e.start,
                           abort_now=True)
                elif not e.published and now - e.start >= limit / 2:
                    e.published = True
                    e.pg._publish_waiting(e.seq, e.call)
            time.sleep(_TICK)


_watchdog = _Watchdog()
start = _watchdog.start
finish = _watchdog.finish
