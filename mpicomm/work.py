"""Handles for asynchronous operations."""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch
from mpi4py import MPI


class Work:
    """A pending (or finished) operation: ``wait()``, ``is_completed()``, ``get_future()``.

    Results land in the caller's buffers when the operation completes (in ``wait()``, or when
    ``is_completed()`` first sees it done), never before.
    """

    def __init__(self, request: MPI.Request | None, finish: Sequence[Callable[[], None]] = (),
                 result: Sequence = ()) -> None:
        self._request = request
        self._finish = list(finish)
        self._result = list(result)
        self._lock = threading.Lock()
        self._done = request is None
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None
        if self._done:
            self._complete()

    def _complete(self) -> None:
        try:
            for step in self._finish:
                step()
        except BaseException as exc:  # keep it for wait() and the future
            self._error = exc
        self._finish = []
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
                self._request.Wait()
                self._complete()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the operation has finished (its results then are in place)."""
        with self._lock:
            if not self._done and self._request.Test():
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
                elif MPI.Query_thread() == MPI.THREAD_MULTIPLE:
                    threading.Thread(target=self._wait_quietly, daemon=True,
                                     name="mpicomm-future").start()
            return self._future

    def _wait_quietly(self) -> None:
        try:
            self.wait()
        except BaseException:  # noqa: BLE001 - delivered through the future
            pass

    def __repr__(self) -> str:
        return f"<mpicomm.Work {'completed' if self._done else 'pending'}>"


class WorkList(Work):
    """Several requests completed together (e.g. a fallback built from point-to-point calls)."""

    def __init__(self, requests: list[MPI.Request], finish=(), result=()) -> None:
        self._requests = requests
        super().__init__(_AllOf(requests) if requests else None, finish, result)


class _AllOf:
    """Duck-typed request over several MPI requests."""

    def __init__(self, requests: list[MPI.Request]) -> None:
        self.requests = requests

    def Wait(self) -> None:  # noqa: N802 - mirrors MPI.Request
        MPI.Request.Waitall(self.requests)

    def Test(self) -> bool:  # noqa: N802
        return MPI.Request.Testall(self.requests)
