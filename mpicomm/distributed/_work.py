"""The process group's work handle: non-blocking MPI operations with a deadline.

A work wraps the mpicomm Work(s) of one process-group call; completion, futures and
``wait(timeout)`` are mpicomm's :class:`~mpicomm.work.BaseWork`. ``async_op=True`` hands it to
mpicomm's progress thread, which completes it (results in place, future set, ``.then``
callbacks run) without the caller polling; below MPI_THREAD_MULTIPLE it is tested on the
caller's thread. The deadline thread (``_deadlines``) keeps its deadline, as it keeps those of
blocking calls: past the process group's timeout the work fails with
:class:`ProcessGroupTimeoutError` and the MPI job is aborted when the process exits, or one more
timeout later at the latest (MPI cannot cancel a collective that a peer never joined, so the
job cannot go on correctly).
"""
from __future__ import annotations

import atexit
import datetime
import logging
import sys
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from mpi4py import MPI

from ..byte_sizes import format_bytes
from ..work import BaseWork, Work
from . import _deadlines

_log = logging.getLogger("mpicomm")
_timed_out: list[str] = []  # messages of the timeouts seen in this process


class ProcessGroupTimeoutError(dist.DistBackendError):
    """A process-group call did not complete within the process group's timeout: the group is
    unusable and the MPI job will be aborted. (``wait(timeout)`` running out is
    ``mpicomm.WaitTimeoutError`` instead: the call goes on.)"""


#: Seconds between writing the reason and aborting: the launcher forwards a rank's output
#: through its own process and may tear the job down before it passed on what was written just
#: before the abort (seen with MPICH's hydra: a job that ended with no output at all).
ABORT_GRACE_S = 1.0


def _abort(reason: str) -> None:
    try:  # a closed or broken stream must not keep the job from ending
        sys.stdout.flush()
        sys.stderr.write(f"mpicomm: aborting the MPI job after a timeout: {reason}\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    time.sleep(ABORT_GRACE_S)
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
           abort_now: bool) -> ProcessGroupTimeoutError:
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
        _deadlines.watch(_deadlines.Deadline(time.monotonic() + timeout.total_seconds(),
                                             lambda: _abort(message)))
    return ProcessGroupTimeoutError(message)


class MpicommWork(BaseWork, dist.Work):
    """A pending (or finished) process-group call: ``wait(timeout=None)``, ``is_completed()``,
    ``get_future()``, ``result()``, ``exception()``."""

    def __init__(self, pg, call: str, seq: int, inner: Sequence[Work],
                 finish: Sequence[Callable[[], None]], result: list, described: Sequence,
                 timeout: datetime.timedelta, source: Work | None = None) -> None:
        super().__init__(result)
        self._pg = pg
        self._call = call
        self._seq = seq
        self._inner = list(inner)
        self._finish = list(finish)
        self._described = described
        self._timeout = timeout
        self._source = source
        self._deadline_key: int | None = None
        if not self._inner:  # completed at launch (a blocking call): finish now
            for step in self._finish:
                step()
            self._finish = []
            self._settle(None)
            return
        self._start = time.monotonic()
        limit = timeout.total_seconds()
        self._deadline = _deadlines.Deadline(
            self._start + limit, self._expire, notice=self._start + limit / 2,
            on_notice=lambda: pg._publish_waiting(seq, call))
        self._deadline_key = _deadlines.watch(self._deadline)

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
            watched = _deadlines.unwatch(self._deadline_key)
            self._deadline_key = None
            if watched is not None and watched.noticed:
                self._pg._publish_waiting(None, None)
        super()._settle(error)

    def _expire(self) -> None:
        """The deadline thread: the call ran past the process group's timeout."""
        with self._lock:
            if self._done:
                return
            self._deadline_key = None  # the deadline thread dropped it
            self._settle(expire(self._pg, self._call, self._seq, self._described, self._timeout,
                                time.monotonic() - self._start, abort_now=False))

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
