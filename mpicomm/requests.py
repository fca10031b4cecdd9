"""One request over several MPI requests, in phases: the handle of a call MPI makes in pieces.

A call that is more than one MPI request (``large``: one per piece of a count beyond MPI's range;
``reduce16``: exchanges whose later messages depend on earlier ones) hands :class:`Requests` to
``Work``, which waits and tests it as it would one ``MPI.Request``.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

from mpi4py import MPI

#: What calls that failed midway left behind (their phases, requests and buffers): MPI may still
#: read or write that memory, so it is never freed (one entry per failed call).
ABANDONED: list = []


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
                MPI.Request.Waitall(self._reqs)
                self._advance()
        except MPI.Exception:
            self._abandon()
            raise

    def Test(self, status: MPI.Status | None = None) -> bool:  # noqa: N802
        """Advance as far as completed messages allow; whether everything is done."""
        try:
            while self._reqs is not None:
                if not MPI.Request.Testall(self._reqs):
                    return False
                self._advance()
        except MPI.Exception:
            self._abandon()
            raise
        return True
