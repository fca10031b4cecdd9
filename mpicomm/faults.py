"""Rank failures as errors (ULFM): :class:`RankFailedError`, whether this MPI tolerates failures,
and the MPI errors that mean a failure.

With an MPI that implements User-Level Failure Mitigation (Open MPI 5 launched with
``mpirun --with-ft ulfm``) a peer's death makes MPI calls fail with ``MPI_ERR_PROC_FAILED``,
``MPI_ERR_PROC_FAILED_PENDING`` or ``MPI_ERR_REVOKED`` instead of ending the job; mpicomm raises
those as :class:`RankFailedError` and revokes the communicator, so that every survivor leaves
whatever call it is in on that communicator (a multi-step call included) within the failure
detector's delay.

Why mpicomm sets ``OMPI_MCA_btl=tcp,self`` under ULFM (``ft_env``; measured with Open MPI 5.0.11,
3 ranks on one node, a rank leaving with ``os._exit(9)`` between two ``Allreduce``): over the default
shared-memory transport the survivors hung (40 s, until killed); over TCP they got
``MPI_ERR_PROC_FAILED`` 3-12 ms after the death. Over shared memory a death was detected (in 12 ms)
only when the rank was killed by a signal (``SIGKILL``) or exited with status 0 without finalising:
PRRTE reports a non-zero exit status as an exit, not as a process failure, and shared memory has
no connection whose loss the transport itself would notice, while a TCP connection breaks when its
peer's process ends, however it ends.
"""
from __future__ import annotations

import time

from mpi4py import MPI

from .ft_env import FT_VAR, launched_with_ft

try:
    from torch.distributed import DistBackendError as _Base
except ImportError:  # pragma: no cover - torch without distributed
    _Base = RuntimeError

# MPI error classes that mean "a process failed" (MPICH's mpi4py maps the names to one unknown
# class: those never mean a failure there).
_FAILURE_CLASSES = frozenset(
    c for c in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED)
    if c not in (MPI.ERR_UNKNOWN, MPI.ERR_OTHER, MPI.ERR_INTERN))
#: How long a rank whose communicator was revoked by a peer waits to learn which rank failed
#: (the failure detector tells every process; a revoke after a timeout names none).
LEARN_FAILED_S = 0.5


class RankFailedError(_Base):
    """A rank of the communicator failed (or a peer revoked it after a failure or a timeout):
    the call did not complete. ``failed_ranks``: the failed ranks of the communicator that
    raised, sorted (empty when this rank does not know them yet). A
    ``torch.distributed.DistBackendError`` too, so process-group users catch either.

    Go on with ``comm.shrink()`` (the survivors) and
    ``mpicomm.distributed.reinit_process_group``."""

    def __init__(self, message: str, failed_ranks: tuple[int, ...] = (),
                 error_class: int | None = None) -> None:
        super().__init__(message)
        self.failed_ranks: tuple[int, ...] = tuple(sorted(failed_ranks))
        self.error_class = error_class


_state: bool | None = None


def fault_tolerant() -> bool:
    """Whether this MPI turns a peer's death into errors (Open MPI with ULFM, enabled at launch)."""
    global _state
    if _state is None:
        _state = (MPI.Get_library_version().startswith("Open MPI") and bool(_FAILURE_CLASSES)
                  and hasattr(MPI.Comm, "Revoke") and launched_with_ft())
    return _state


def require(what: str) -> None:
    """Raise unless :func:`fault_tolerant`, naming what is needed for ``what``."""
    if fault_tolerant():
        return
    library = MPI.Get_library_version().splitlines()[0].strip()
    if not library.startswith("Open MPI"):
        need = ("an MPI with User-Level Failure Mitigation: Open MPI 5 built with ULFM "
                "(`ompi_info` says \"FT MPI support: yes\"), launched with "
                "`mpirun --with-ft ulfm`")
    else:
        need = ("fault tolerance enabled at launch: `mpirun --with-ft ulfm ...` (sets "
                f"{FT_VAR}=1); without it Open MPI ends the job when a rank dies")
    raise RuntimeError(f"mpicomm: {what} needs {need}; this MPI is {library!r}")


def is_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is an MPI error that means a process failed or the communicator was revoked."""
    return isinstance(exc, MPI.Exception) and exc.Get_error_class() in _FAILURE_CLASSES


def failed_ranks(mpi_comm: MPI.Comm) -> tuple[int, ...]:
    """The ranks of ``mpi_comm`` this process knows to have failed, sorted (local)."""
    failed = mpi_comm.Get_failed()
    try:
        if failed.Get_size() == 0:
            return ()
        group = mpi_comm.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), group)
        finally:
            group.Free()
    finally:
        failed.Free()
    return tuple(sorted(r for r in ranks if r != MPI.UNDEFINED))


def describe_failure(call: str, where: str, exc: MPI.Exception, mpi_comm: MPI.Comm) -> RankFailedError:
    """The :class:`RankFailedError` for MPI failure ``exc`` raised by ``call`` on ``mpi_comm``."""
    cls = exc.Get_error_class()
    ranks = failed_ranks(mpi_comm)
    if not ranks and cls == MPI.ERR_REVOKED:
        until = time.monotonic() + LEARN_FAILED_S
        while not ranks and time.monotonic() < until:
            time.sleep(0.01)
            ranks = failed_ranks(mpi_comm)
    if ranks:
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} failed"
    else:
        who = "a peer revoked the communicator (a failure or a timeout elsewhere; no failed rank known here)"
    name = {MPI.ERR_PROC_FAILED: "MPI_ERR_PROC_FAILED", MPI.ERR_REVOKED: "MPI_ERR_REVOKED",
            MPI.ERR_PROC_FAILED_PENDING: "MPI_ERR_PROC_FAILED_PENDING"}.get(cls, str(cls))
    return RankFailedError(
        f"mpicomm: {call} on {where}: {who} ({name}); the communicator is revoked: go on with "
        "comm.shrink() (the survivors) and mpicomm.distributed.reinit_process_group", ranks, cls)
