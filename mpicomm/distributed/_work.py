"""The process group's work handle: non-blocking MPI operations with a deadline.

A work wraps the mpicomm Work(s) of one process-group call; completion, futures and
``wait(timeout)`` are mpicomm's :class:`~mpicomm.work.BaseWork`. ``async_op=True`` hands it to
mpicomm's progress thread, which completes it (results in place, future set, ``.then``
callbacks run) without the caller polling; a blocking call, and any call below
MPI_THREAD_MULTIPLE, is tested on the caller's thread: a blocking call first in a tight loop
for :data:`SPIN_S` (done by then, it returns a completed work made without a deadline: most
small calls), then keeping its deadline and yielding the core between tests, so that a long
wait gives the core to a peer rank that needs it. The deadline thread (``_deadlines``)
keeps the deadline of a work on the progress thread, the waiting caller that of any other:
past the process group's timeout the work fails with
:class:`ProcessGroupTimeoutError` in the caller (``wait()``, the future), as gloo's does, and the
group refuses further calls; ``destroy_process_group`` and a new group work. MPI cannot cancel a
collective that a peer never joined: the operation stays pending in MPI, is reported at exit, and
MPI_Finalize goes ahead without it (neither MPICH nor Open MPI waits for it).
Under a profiler a work records one ``mpicomm:<op>`` event from launch to completion, ended on
the progress thread (an async event, as torch's backends record theirs).
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
import threading
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..byte_sizes import format_bytes
from ..work import BaseWork, Work
from . import _deadlines

_log = logging.getLogger("mpicomm")
#: A blocking call tests its MPI operation in a tight loop for this long (seconds, at most half
#: its timeout) before it sets up a deadline and waits with :meth:`MpicommWork._block`, which
#: from then on yields the core between tests. It never sleeps: MPI progresses a non-blocking
#: collective only inside its tests (a nap between them would stall every step of a large one).
SPIN_S = 200e-6
_monotonic = time.monotonic
_yield = os.sched_yield  # another thread or process runnable on this core runs first
# (description, MPI works) of every call that timed out in this process: MPI may still hold them
_left_pending: list[tuple[str, list]] = []


class ProcessGroupTimeoutError(dist.DistBackendError):
    """A process-group call did not complete within the process group's timeout: the group
    refuses further calls (destroy it and create a new one). (``wait(timeout)`` running out is
    ``mpicomm.WaitTimeoutError`` instead: the call goes on.)"""


@atexit.register
def _report_pending() -> None:
    """Say which timed-out operations MPI still holds as the process exits."""
    try:  # neither a closed stream nor a failing test may keep the process from exiting
        pending = [where for where, inner in _left_pending
                   if any(not w.is_completed() for w in inner)]
        if pending:
            sys.stderr.write(f"mpicomm: exiting with {len(pending)} operation(s) that timed out "
                             "still pending in MPI (MPI cannot cancel a collective a peer never "
                             "joined); MPI_Finalize goes ahead without them:\n"
                             + "".join(f"  {m}\n" for m in pending))
            sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass


def finished_by(inner: Sequence[Work], until: float) -> bool:
    """Test the mpicomm works ``inner`` (held by this thread alone) in a tight loop until every
    one is done (True) or monotonic time ``until`` has passed (False)."""
    while True:
        for w in inner:
            if not w._done and not w._test():
                break
        else:
            return True
        if _monotonic() >= until:
            return False


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


class MpicommWork(BaseWork, dist.Work):
    """A pending (or finished) process-group call: ``wait(timeout=None)``, ``is_completed()``,
    ``get_future()``, ``result()``, ``exception()``."""

    # what a work completed on the caller's thread keeps as it is (see `completed`)
    _record = _source = _deadline_key = _deadline = _timeout = None
    _described: Sequence = ()

    def __init__(self, pg, call: str, seq: int, inner: Sequence[Work],
                 finish: Sequence[Callable[[], None]], result: list, described: Sequence,
                 timeout: datetime.timedelta, source: Work | None = None,
                 record=None, started: float | None = None) -> None:
        super().__init__(result)
        self._record = record  # the profiler event, ended when the work completes
        self._pg = pg
        self._call = call
        self._seq = seq
        self._inner = list(inner)
        self._finish = list(finish)
        self._described = described
        self._timeout = timeout
        self._source = source
        self._deadline_key: int | None = None  # while the deadline thread keeps the deadline
        self._deadline: _deadlines.Deadline | None = None
        if not self._inner:  # completed at launch (a blocking call): finish now
            for step in self._finish:
                step()
            self._finish = []
            self._settle(None)
            return
        self._start = time.monotonic() if started is None else started
        limit = timeout.total_seconds()
        self._deadline = _deadlines.Deadline(
            self._start + limit, self._expire, notice=self._start + limit / 2,
            on_notice=lambda: pg._publish_waiting(seq, call))

    def _launch_threaded(self) -> None:
        """The progress thread completes the work; the deadline thread keeps its deadline."""
        if not self._done:
            self._deadline_key = _deadlines.watch(self._deadline)
        super()._launch_threaded()

    @classmethod
    def completed(cls, pg, call: str, seq: int, result: list, source=None) -> "MpicommWork":
        """A blocking call that completed on the caller's thread, its results in place: the
        work it returns, made without a deadline (what ``__init__`` does for it, cheaper)."""
        work = cls.__new__(cls)
        dist.Work.__init__(work)
        work._result = result if isinstance(result, list) else list(result)
        work._lock = threading.RLock()
        work._done, work._inner, work._finish = True, [], []
        work._pg, work._call, work._seq = pg, call, seq
        if source is not None:
            work._source = source
        return work

    def _block(self) -> None:
        """Test on this thread until done, keeping the deadline here (no other thread woken):
        tests in a tight loop for :data:`SPIN_S` since the call began, then yields the core
        between tests. Only this thread holds the inner works (the work is not the progress
        thread's): they are tested directly, without their locks."""
        d, inner, began = self._deadline, self._inner, self._start
        while not self._done:
            if all(w._done or w._test() for w in inner):
                with self._lock:
                    if not self._done:
                        self._test()
                return
            now = _monotonic()
            if now >= d.notice and not d.noticed:
                d.noticed = True
                d.on_notice()
            if now >= d.due:
                self._expire()
                return
            if now - began >= SPIN_S:
                _yield()

    # -- completion -------------------------------------------------------------------------

    def _test(self) -> bool:
        if any(not w.is_completed() for w in self._inner):
            return False
        error = next((w.exception() for w in self._inner if w.exception() is not None), None)
        if error is None:
            try:
                for step in self._finish:
                    step()
            except BaseException as exc:  # noqa: BLE001 - delivered by wait()/the future
                error = exc
        self._settle(error)
        return True

    def _settle(self, error: BaseException | None) -> None:
        self._finish = []
        if error is None:
            self._inner = []
        if self._deadline_key is not None:
            _deadlines.unwatch(self._deadline_key)
            self._deadline_key = None
        if self._deadline is not None and self._deadline.noticed:
            self._pg._publish_waiting(None, None)
        if self._record is not None:
            record, self._record = self._record, None
            record.end()
        super()._settle(error)

    def _expire(self) -> None:
        """The deadline thread: the call ran past the process group's timeout. The caller gets
        the error; the group refuses further calls; MPI keeps the operation pending."""
        with self._lock:
            if self._done:
                return
            self._deadline_key = None  # the deadline thread dropped it (or never had it)
            pg, where = self._pg, (f"{self._call} ({_describe(self._described)}), operation "
                                   f"#{self._seq} of process group {self._pg.group_name!r} on "
                                   f"rank {self._pg.rank()} of {self._pg.size()}")
            message = (f"mpicomm: {where}, did not complete within the process group's timeout "
                       f"of {self._timeout.total_seconds():g} s (waited "
                       f"{time.monotonic() - self._start:.1f} s). "
                       f"{pg._peers_report(self._seq, self._call)} The process group refuses "
                       "further calls: destroy it and create a new one.")
            _log.error(message)
            pg._broken = f"after an earlier timeout: {message}"
            if pg.comm is not None and pg.comm.fault_tolerant:
                # ULFM: end the operation on every rank (theirs fail with RankFailedError)
                pg.comm._revoke_quietly()
            _left_pending.append((where, self._inner))
            self._settle(ProcessGroupTimeoutError(message))

    # -- the future -------------------------------------------------------------------------

    def _make_future(self) -> tuple[torch.futures.Future, torch.futures.Future]:
        """A future whose failure torch's C++ side sees as one: DDP's reducer reads a process
        group's future in C++, where a Python future's ``set_exception`` is a value (the error
        object) and a failed call crashed the process. The returned future is a ``then`` of the
        one this work completes, raising the work's error in its callback (a C++ error; Python
        sees a RuntimeError naming it); ``wait()`` on the work raises the error itself."""
        source = torch.futures.Future()
        return source, source.then(self._future_value)

    def _future_value(self, _source) -> list:
        if self._error is not None:
            raise self._error
        return self._result

    def _complete_future(self, fut: torch.futures.Future, error: BaseException | None) -> None:
        fut.set_result(None)

    def _describe(self) -> str:
        return f"{self._call} (operation #{self._seq})"

    # -- torch's Work interface beyond BaseWork ---------------------------------------------

    def _source_rank(self) -> int:
        """The group rank a receive matched (what ``dist.recv(src=None)`` returns)."""
        self.wait()
        if self._source is None:
            raise RuntimeError(f"mpicomm: {self._call} is not a receive; it has no source rank")
        return self._source.source_rank()

    source_rank = _source_rank

    def __repr__(self) -> str:
        state = "completed" if self._done else "pending"
        return f"<mpicomm {self._call} work #{self._seq} {state}>"
