"""Handles for asynchronous operations: one completion mechanism for every handle.

:class:`BaseWork` holds what every handle does the same way: results in place once, the error
kept for ``wait()`` and the future, ``result``/``exception``, a torch Future, and
``wait(timeout)``. :class:`Work` (mpicomm's calls) and the process group's
``mpicomm.distributed.MpicommWork`` differ only in how they test and finish their operation.
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Callable, Sequence

import torch
from mpi4py import MPI

from . import progress_thread, requests
from .buffers import IN, Slot


class WaitTimeoutError(TimeoutError):
    """``wait(timeout)`` ran out before the operation completed; the operation goes on."""


def timeout_seconds(timeout) -> float | None:
    """``wait``'s timeout in seconds: None for no limit (None, 0, or torch's default timedelta(0))."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if seconds < 0:
        raise ValueError(f"wait() got unexpected value for argument \"timeout\" (expected: None, "
                         f"seconds >= 0 or a timedelta, got: {timeout!r})")
    return seconds or None


class BaseWork:
    """A pending (or finished) operation: ``wait(timeout=None)``, ``is_completed()``,
    ``is_success()``, ``exception()``, ``result()``, ``get_future()``.

    Results land in the caller's buffers when the operation completes (in ``wait()``, when
    ``is_completed()`` first sees it done, or on the progress thread), never before. Subclasses
    implement ``_test()`` (test once; finish and ``_settle`` when done; called under the lock)
    and may implement ``_block()`` (block until done) and ``_describe()``.
    """

    # the state of a new work (class attributes: one handle less to set up per call)
    _done = False
    _error: BaseException | None = None
    _future: torch.futures.Future | None = None
    _future_source: torch.futures.Future | None = None
    # set when only the progress thread completes this work: waiters wait on it
    _event: threading.Event | None = None

    def __init__(self, result: Sequence = ()) -> None:
        super().__init__()
        self._result = result if isinstance(result, list) else list(result)
        self._lock = threading.RLock()

    # -- what subclasses provide ------------------------------------------------------------

    def _test(self) -> bool:
        """Test the operation once; when it is done, finish it and ``_settle``. True when done."""
        raise NotImplementedError

    def _block(self) -> None:
        """Block until the operation is done and settled (default: test until done, taking the
        lock only for each test, so that another thread, e.g. the deadline thread, may settle)."""
        while not self._poll():
            pass

    def _describe(self) -> str:
        return "the operation"

    def _on_future(self) -> None:
        """A future was asked for while the operation is pending."""

    # -- completion -------------------------------------------------------------------------

    def _settle(self, error: BaseException | None) -> None:
        """Record the outcome (under the lock): done, the error, the future, waiters woken."""
        self._error = error
        self._done = True
        if self._event is not None:
            self._event.set()
        fut = self._future_source
        if fut is not None and not fut.done():
            self._complete_future(fut, error)

    def _make_future(self) -> tuple[torch.futures.Future, torch.futures.Future]:
        """(the future this work completes, the future ``get_future`` returns): one future."""
        fut = torch.futures.Future()
        return fut, fut

    def _complete_future(self, fut: torch.futures.Future, error: BaseException | None) -> None:
        """Complete ``fut`` (from :meth:`_make_future`) with the outcome."""
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(self._result)

    def _poll(self, now: float | None = None) -> bool:
        """Test once unless another thread holds the work (progress-thread hook). True when done."""
        if self._done:
            return True
        if not self._lock.acquire(blocking=False):
            return False  # another thread is testing or waiting: it settles the work
        try:
            return self._done or self._test()
        finally:
            self._lock.release()

    def _launch_threaded(self) -> None:
        """From now on only the progress thread completes this work; waiters wait for it."""
        self._event = threading.Event()
        if self._done:
            self._event.set()
        progress_thread.add(self)

    # -- the public interface ---------------------------------------------------------------

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        """Block until complete (results in place) and return True, or raise the operation's
        error. With ``timeout`` (seconds or a timedelta; None or 0: no limit), raise
        :class:`WaitTimeoutError` if it is still pending then; it goes on, ``wait()`` again."""
        limit = timeout_seconds(timeout)
        if not self._done:
            if self._event is not None:
                self._event.wait(limit)
            elif limit is None:
                self._block()
            else:
                until = time.monotonic() + limit
                while not self._poll() and time.monotonic() < until:
                    pass
            if not self._done:
                raise WaitTimeoutError(
                    f"mpicomm: {self._describe()} did not complete within wait(timeout={limit:g} s); "
                    "it goes on, wait() again to complete it")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the operation has finished (results then in place, or failed)."""
        if not self._done and self._event is None:
            self._poll()
        return self._done

    def is_success(self) -> bool:
        """Whether the operation finished without error."""
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        """The error the operation ended with, if any."""
        return self._error

    def result(self) -> list:
        """The output buffers (waits for completion)."""
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A torch Future completed with the output buffers when the operation completes."""
        with self._lock:
            if self._future is None:
                self._future_source, self._future = self._make_future()
                if self._done:
                    self._complete_future(self._future_source, self._error)
                else:
                    self._on_future()
            return self._future


class Work(BaseWork):
    """An mpicomm call in flight: one MPI request, the steps that put results in place."""

    def __init__(self, request: MPI.Request | None, finish: Sequence[Callable[[], None]] = (),
                 result: Sequence = (), keep: Sequence = (), comm=None) -> None:
        super().__init__(result)
        self._request = request
        self._keep = list(keep)  # buffers MPI reads or writes until completion (e.g. temporaries)
        self._finish = list(finish)
        self._status = MPI.Status()
        self._comm = comm  # the Communicator that started it: its failures become RankFailedError
        if request is None:
            self._complete()

    def _complete(self) -> None:
        error = None
        try:
            for step in self._finish:
                step()
        except BaseException as exc:  # noqa: BLE001 - kept for wait() and the future
            error = exc
        self._finish = []
        self._keep = []
        self._settle(error)

    def _fail(self, exc: BaseException) -> None:
        """The operation ended with an MPI error: nothing is written back, the error is kept
        (a rank failure as RankFailedError, the communicator revoked)."""
        if self._comm is not None:
            exc = self._comm._surface(exc, "wait")
        if isinstance(self._request, MPI.Request):  # done (with its error): MPI holds no buffer
            for slot in self._keep:
                if isinstance(slot, Slot):
                    slot.role = IN  # release staging memory without writing anything back
                    slot.finish()
        else:  # several requests, some maybe still pending in MPI: keep their buffers
            requests.ABANDONED.append(self._keep)
        self._finish = []
        self._keep = []
        self._settle(exc)

    def _test(self) -> bool:
        try:
            done = self._request.Test(self._status)
        except MPI.Exception as exc:
            self._fail(exc)
            return True
        if done:
            self._complete()
        return self._done

    def _block(self) -> None:
        with self._lock:
            if not self._done:
                try:
                    self._request.Wait(self._status)
                except MPI.Exception as exc:
                    self._fail(exc)
                    return
                self._complete()

    def _on_future(self) -> None:
        if progress_thread.enabled():  # the progress thread completes the future; wait() still may
            progress_thread.add(self)

    def source_rank(self) -> int:
        """The rank a completed receive came from (what ``irecv(src=None)`` matched)."""
        self.wait()
        if self._request is None:
            raise RuntimeError("source_rank(): this operation was not a receive")
        return self._status.Get_source()

    def __repr__(self) -> str:
        return f"<mpicomm.Work {'completed' if self._done else 'pending'}>"
