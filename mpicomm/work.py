"""Handles for asynchronous operations."""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch
from mpi4py import MPI

from . import progress


class Work:
    """A pending (or finished) operation: ``wait()``, ``is_completed()``, ``get_future()``.

    Results land in the caller's buffers when the operation completes (in ``wait()``, or when
    ``is_completed()`` first sees it done), never before.
    """

    def __init__(self, request: MPI.Request | None, finish: Sequence[Callable[[], None]] = (),
                 result: Sequence = (), keep: Sequence = ()) -> None:
        self._request = request
        self._keep = list(keep)  # buffers MPI reads or writes until completion (e.g. temporaries)
        self._finish = list(finish)
        self._result = list(result)
        self._lock = threading.RLock()
        self._done = request is None
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None
        self._status = MPI.Status()
        if self._done:
            self._complete()

    def _complete(self) -> None:
        try:
            for step in self._finish:
                step()
        except BaseException as exc:  # keep it for wait() and the future
            self._error = exc
        self._finish = []
        self._keep = []
        self._done = True
        fut = self._future
        if fut is not None and not fut.done():
            if self._error is not None:
                fut.set_exception(self._error)
            else:
                fut.set_result(self._result)

    def wait(self, timeout=None) -> bool:
        """Block until the operation is complete and its results are in place; return True."""
        if timeout is not None:
            raise NotImplementedError("Work.wait(timeout=...) is not supported by MPI requests; "
                                      "poll is_completed() instead")
        with self._lock:
            if not self._done:
                self._request.Wait(self._status)
                self._complete()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the operation has finished (its results then are in place)."""
        with self._lock:
            if not self._done and self._request.Test(self._status):
                self._complete()
            return self._done

    def is_success(self) -> bool:
        """Whether the operation finished without error."""
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        """The error the operation ended with, if any."""
        return self._error

    def result(self) -> list:
        """The output buffers (after wait())."""
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A torch Future completed with the output buffers when the operation completes."""
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._done:
                    if self._error is not None:
                        self._future.set_exception(self._error)
                    else:
                        self._future.set_result(self._result)
                elif progress.enabled():
                    progress.add(self)
            return self._future

    def source_rank(self) -> int:
        """The rank a completed receive came from (what ``irecv(src=None)`` matched)."""
        self.wait()
        if self._request is None:
            raise RuntimeError("source_rank(): this operation was not a receive")
        return self._status.Get_source()

    def _poll(self, now: float) -> bool:
        """Progress-engine hook: test once; True when complete (the future is then set)."""
        if not self._lock.acquire(blocking=False):
            return False  # a caller is in wait(): it completes the operation and the future
        try:
            if not self._done and self._request.Test(self._status):
                self._complete()
            return self._done
        finally:
            self._lock.release()

    def __repr__(self) -> str:
        return f"<mpicomm.Work {'completed' if self._done else 'pending'}>"
