"""The process group's work handle: non-blocking MPI operations with a deadline.

A work wraps the mpicomm Work(s) of one process-group call. ``async_op=True`` hands it to
mpicomm's progress thread, which completes it (results in place, future set, ``.then``
callbacks run) without the caller polling; below MPI_THREAD_MULTIPLE it is tested on the
caller's thread. Past the process group's timeout the work fails with
:class:`CollectiveTimeoutError` and the MPI job is aborted when the process exits, or one more
timeout later at the latest (MPI cannot cancel a collective that a peer never joined, so the
job cannot go on correctly). Blocking calls are watched by ``_watchdog`` instead.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import sys
import threading
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import progress
from .._util import format_bytes
from ..work import Work

_log = logging.getLogger("mpicomm")
_timed_out: list[str] = []  # messages of the timeouts seen in this process
_SET = threading.Event()  # the event of every work that completed at launch
_SET.set()


class CollectiveTimeoutError(dist.DistBackendError):
    """A process-group call did not complete within the process group's timeout."""


def _abort(reason: str) -> None:
    sys.stderr.write(f"mpicomm: aborting the MPI job after a timeout: {reason}\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


@atexit.register
def _abort_at_exit() -> None:
    """A collective left pending by a timeout would hang MPI_Finalize: abort the job instead."""
    if _timed_out:
        _abort(_timed_out[0])


def _describe(tensors: Sequence) -> str:
    parts, total = [], 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            parts.append(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}")
            total += t.numel() * t.element_size()
    if not parts:
        return "no tensors"
    shown = ", ".join(parts[:4]) + (f", ... ({len(parts)} tensors)" if len(parts) > 4 else "")
    return f"{shown}; {_size(total)}"


def _size(nbytes: int) -> str:
    return format_bytes(nbytes)


def expire(pg, call: str, seq: int, described, timeout: datetime.timedelta, elapsed: float,
           abort_now: bool) -> CollectiveTimeoutError:
    """A call of ``pg`` ran past ``timeout``: log, break the group, abort the job (now or later)."""
    message = (f"mpicomm: {call} ({_describe(described)}), operation #{seq} of process group "
               f"{pg.group_name!r} on rank {pg.rank()} of {pg.size()}, did not complete within "
               f"the process group's timeout of {timeout.total_seconds():g} s (waited "
               f"{elapsed:.1f} s). {pg._peers_report(seq, call)} The process group is unusable "
               "now; the MPI job will be aborted.")
    _log.error(message)
    pg._broken = message
    if abort_now:
        _abort(message)
    if not _timed_out:
        _timed_out.append(message)
        timer = threading.Timer(timeout.total_seconds(), _abort, (message,))
        timer.daemon = True
        timer.start()
    return CollectiveTimeoutError(message)


class MpicommWork(dist.Work):
    """A pending (or finished) process-group call: ``wait()``, ``is_completed()``, ``get_future()``."""

    def __init__(self, pg, call: str, seq: int, inner: Sequence[Work],
                 finish: Sequence[Callable[[], None]], result: list, described: Sequence,
                 timeout: datetime.timedelta, source: Work | None = None) -> None:
        super().__init__()
        self._pg = pg
        self._call = call
        self._seq = seq
        self._inner = list(inner)
        self._finish = list(finish)
        self._result = result
        self._described = described
        self._timeout = timeout
        self._start = time.monotonic()
        self._deadline = self._start + timeout.total_seconds()
        self._published = False
        self._source = source
        self._lock = threading.RLock()
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None
        self._threaded = False
        if self._inner:
            self._event = threading.Event()
        else:  # completed at launch (a blocking call): finish now, share one set event
            self._event = _SET
            for step in self._finish:
                step()
            self._finish = []

    # -- completion -------------------------------------------------------------------------

    def _poll(self, now: float) -> bool:
        """Test once; complete (or time out) when due. True when finished."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._event.is_set():
                return True
            pending = [w for w in self._inner if not w.is_completed()]
            if not pending:
                error = next((w.exception() for w in self._inner if w.exception() is not None), None)
                if error is None:
                    try:
                        for step in self._finish:
                            step()
                    except BaseException as exc:  # noqa: BLE001 - delivered by wait()/the future
                        error = exc
                self._settle(error)
                return True
            if now >= self._deadline:
                self._settle(self._timeout_error())
                return True
            if not self._published and now >= self._start + self._timeout.total_seconds() / 2:
                self._published = True
                self._pg._publish_waiting(self._seq, self._call)
            return False
        finally:
            self._lock.release()

    def _settle(self, error: BaseException | None) -> None:
        self._error = error
        self._finish = []
        self._inner = [] if error is None else self._inner
        if self._published and error is None:
            self._pg._publish_waiting(None, None)
        self._event.set()
        fut = self._future
        if fut is not None:
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(self._result)

    def _timeout_error(self) -> CollectiveTimeoutError:
        return expire(self._pg, self._call, self._seq, self._described, self._timeout,
                      time.monotonic() - self._start, abort_now=False)

    def _launch_threaded(self) -> None:
        self._threaded = True
        progress.add(self)

    # -- torch's Work interface -------------------------------------------------------------

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until complete (results in place); raise its error, or CollectiveTimeoutError."""
        limit = timeout.total_seconds() if timeout else 0.0
        if self._threaded:
            done = self._event.wait(limit if limit > 0 else None)
        else:
            until = time.monotonic() + limit if limit > 0 else float("inf")
            while not self._poll(time.monotonic()) and time.monotonic() < until:
                pass
            done = self._event.is_set()
        if not done:
            raise CollectiveTimeoutError(
                f"mpicomm: {self._call} (operation #{self._seq}) did not complete within "
                f"wait(timeout={limit:g} s); it goes on, wait() again to complete it")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the call has finished (results in place, or failed)."""
        if not self._threaded and not self._event.is_set():
            self._poll(time.monotonic())
        return self._event.is_set()

    def is_success(self) -> bool:
        """Whether the call finished without error."""
        return self.is_completed() and self._error is None

    def exception(self):
        """The error the call ended with, if any."""
        return self._error

    def result(self) -> list:
        """The output tensors (after wait())."""
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A torch Future completed with the output tensors when the call completes."""
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._event.is_set():
                    if self._error is not None:
                        self._future.set_exception(self._error)
                    else:
                        self._future.set_result(self._result)
            return self._future

    def _source_rank(self) -> int:
        """The group rank a receive matched (what ``dist.recv(src=None)`` returns)."""
        self.wait()
        if self._source is None:
            raise RuntimeError(f"mpicomm: {self._call} is not a receive; it has no source rank")
        return self._source.source_rank()

    source_rank = _source_rank

    def __repr__(self) -> str:
        state = "completed" if self._event.is_set() else "pending"
        return f"<mpicomm {self._call} work #{self._seq} {state}>"
