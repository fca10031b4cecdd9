"""One request over several MPI requests, in phases: the handle of a call MPI makes in pieces.

A call that is more than one MPI request (``large``: one per piece of a count beyond MPI's range;
``reduce16``: exchanges whose later messages depend on earlier ones) hands :class:`Requests` to
``Work``, which waits and tests it as it would one ``MPI.Request``.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Sequence

from mpi4py import MPI

#: What calls that failed midway left behind (their phases, requests and buffers): MPI may still
#: read or write that memory, so it is never freed (one entry per failed call).
ABANDONED: list = []


@contextlib.contextmanager
def kept_on_failure(*posted, _abandoned: list = ABANDONED) -> Iterator[None]:
    """Keep ``posted`` (the lists a call puts its requests in) for the life of the process if
    the block raises: a pending request whose Python object is collected is freed
    (``MPI_Request_free``), and Open MPI ends the job when such a freed receive later fails
    ("Recv error after request freed"), as it does when a peer dies or the communicator is revoked.
    A generator's frame is collected when an exception leaves it or when it is closed (also as
    the interpreter exits, after the module's globals are gone: hence the bound list)."""
    try:
        yield
    except BaseException:
        _abandoned.append(posted)
        raise


class Requests:
    """MPI requests completed phase by phase (mirrors ``MPI.Request``'s Wait/Test for Work).

    ``phases`` yields lists of requests to complete before it continues (the code after each
    ``yield`` runs once they have); creating a Requests runs it up to its first list, so a
    call's first messages go out when the call is made. ``release`` runs once, after the last.
    """

    def __init__(self, phases: Iterator[list], release: Iterable[Callable[[], None]] = ()) -> None:
        self._phases = phases
        self._release = list(release)
        self._reqs: list | None = None
        try:
            self._advance()
        except MPI.Exception:
            self._abandon()
            raise

    @classmethod
    def together(cls, requests: Sequence[MPI.Request]) -> "Requests":
        """Requests of one phase: ``requests``, all issued already."""
        return cls(iter([list(requests)]))

    def _advance(self) -> None:
        try:
            self._reqs = next(self._phases)
        except StopIteration:
            self._reqs = None
            for fn in self._release:
                fn()
            self._release = []

    def _abandon(self) -> None:
        """An MPI call failed (e.g. a rank died): no later phase runs, and nothing is handed
        back: requests of this phase may still be pending in MPI over its memory, so the phases
        (and the memory they hold) are kept for the life of the process."""
        ABANDONED.append((self._phases, self._reqs, self._release))
        self._reqs = None
        self._release = []

    def Wait(self, status: MPI.Status | None = None) -> None:  # noqa: N802 - as MPI.Request
        """Run every remaining phase."""
        try:
            while self._reqs is not None:
                _all(MPI.Request.Waitall, self._reqs)
                self._advance()
        except MPI.Exception:
            self._abandon()
            raise

    def Test(self, status: MPI.Status | None = None) -> bool:  # noqa: N802
        """Advance as far as completed messages allow; whether everything is done."""
        try:
            while self._reqs is not None:
                if not _all(MPI.Request.Testall, self._reqs):
                    return False
                self._advance()
        except MPI.Exception:
            self._abandon()
            raise
        return True


def _all(call, reqs: list):
    """``call(reqs)`` (Waitall or Testall); MPI_ERR_IN_STATUS raised as the first request's
    own error (e.g. MPI_ERR_PROC_FAILED), so that a failure is recognised."""
    statuses = [MPI.Status() for _ in reqs]
    try:
        return call(reqs, statuses)
    except MPI.Exception as exc:
        if exc.Get_error_class() != MPI.ERR_IN_STATUS:
            raise
        codes = [st.Get_error() for st in statuses]
        first = next((c for c in codes if c not in (MPI.SUCCESS, MPI.ERR_PENDING)), None)
        if first is None:
            raise
        raise MPI.Exception(first) from exc
