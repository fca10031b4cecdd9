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

import array
import atexit
import time
from typing import Callable

from mpi4py import MPI

from . import ft_env
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
    if _state and ft_env.too_late:
        raise RuntimeError(f"mpicomm: {ft_env.too_late}")
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


def is_failure(exc: BaseException, mpi_comm: MPI.Comm | None = None) -> bool:
    """Whether ``exc`` is an MPI error that means a process failed or the communicator was
    revoked. With ``mpi_comm`` (where it was raised), under ULFM any MPI error there counts once
    the communicator is revoked or has failed ranks (Open MPI's non-blocking collectives on a
    revoked communicator fail with MPI_ERR_OTHER)."""
    if not isinstance(exc, MPI.Exception):
        return False
    if exc.Get_error_class() in _FAILURE_CLASSES:
        return True
    if mpi_comm is None or not fault_tolerant():
        return False
    try:
        return bool(mpi_comm.Is_revoked() or failed_ranks(mpi_comm))
    except MPI.Exception:  # noqa: BLE001 - a communicator MPI no longer answers for
        return False


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


#: After a rank failure, how long this process may take to exit (MPI_Finalize included) before
#: SIGALRM ends it: Open MPI 5.0.11's MPI_Finalize hung now and then (spinning in opal_progress)
#: in survivors of a failure, keeping the job from ending.
EXIT_GRACE_S = 20
_exit_guarded = False


def agree(mpi_comm: MPI.Comm, bits: int, name: str = "a communicator", every_rank: bool = False) -> int:
    """ULFM's MPI_Comm_agree on ``mpi_comm``: the bitwise AND of the non-negative int ``bits``
    over the surviving ranks, the same on every survivor even when ranks fail during the call.
    ``every_rank``: 0 unless every rank of ``mpi_comm`` took part (none had failed, known to a
    survivor, before or during the call)."""
    return _agree(mpi_comm, bits, name, lambda v: int(mpi_comm.Agree(v)), every_rank)


def iagree(mpi_comm: MPI.Comm, bits: int, name: str = "a communicator", idle_s: float = 0.0,
           timeout_s: float | None = None) -> int:
    """``agree`` through the non-blocking MPI_Comm_iagree, which matches only non-blocking
    agreements on the other ranks: waited for at once, or with ``idle_s`` > 0 tested every
    ``idle_s`` seconds and slept between (no CPU taken while waiting: Open MPI's blocking calls
    spin). ``timeout_s``: raise ``TimeoutError`` after that long (the request stays posted: for
    a process about to end)."""
    def post(v: int) -> int:
        flag = array.array("i", [v])
        req = mpi_comm.Iagree(flag)
        if idle_s > 0 or timeout_s is not None:
            end = None if timeout_s is None else time.monotonic() + timeout_s
            while not req.Test():
                if end is not None and time.monotonic() > end:
                    raise TimeoutError(f"mpicomm: agree() on {name} did not end within {timeout_s} s")
                time.sleep(idle_s or 0.001)
        else:
            req.Wait()
        return int(flag[0])
    return _agree(mpi_comm, bits, name, post)


def _agree(mpi_comm: MPI.Comm, bits: int, name: str, post: Callable[[int], int], every_rank: bool = False) -> int:
    if not 0 <= int(bits) < 2**31:
        raise ValueError(f"mpicomm: agree() expected an int in [0, 2**31), got {bits!r}")
    bits = int(bits)
    for _ in range(mpi_comm.Get_size() + 1):
        mpi_comm.Ack_failed()       # failures known here do not fail the agreement
        if every_rank and failed_ranks(mpi_comm):
            bits = 0
        try:
            return post(bits)
        except MPI.Exception as exc:
            if exc.Get_error_class() != MPI.ERR_PROC_FAILED:
                raise RuntimeError(f"mpicomm: agree() on {name} failed: {exc}") from exc
            # a rank failed before or during the agreement: every survivor sees it (the error is
            # uniform), acknowledges it and agrees again
            bits = 0 if every_rank else bits
    raise RuntimeError(f"mpicomm: agree() on {name} did not settle after {mpi_comm.Get_size() + 1} tries")


def _guard_exit() -> None:
    """After a failure: bound the exit (``EXIT_GRACE_S``), once per process."""
    global _exit_guarded
    if _exit_guarded:
        return
    _exit_guarded = True

    def arm() -> None:
        import signal

        if hasattr(signal, "alarm") and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None):
            signal.alarm(EXIT_GRACE_S)
    atexit.register(arm)


def describe_failure(call: str, where: str, exc: MPI.Exception, mpi_comm: MPI.Comm) -> RankFailedError:
    """The :class:`RankFailedError` for MPI failure ``exc`` raised by ``call`` on ``mpi_comm``."""
    _guard_exit()
    cls = exc.Get_error_class()
    ranks = failed_ranks(mpi_comm)
    if not ranks and cls != MPI.ERR_PROC_FAILED:
        until = time.monotonic() + LEARN_FAILED_S
        while not ranks and time.monotonic() < until:
            time.sleep(0.01)
            ranks = failed_ranks(mpi_comm)
    if ranks:
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} failed"
    else:
        who = "a peer revoked the communicator (a failure or a timeout elsewhere; no failed rank known here)"
    name = {MPI.ERR_PROC_FAILED: "MPI_ERR_PROC_FAILED", MPI.ERR_REVOKED: "MPI_ERR_REVOKED",
            MPI.ERR_PROC_FAILED_PENDING: "MPI_ERR_PROC_FAILED_PENDING"}.get(
                cls, f"{exc.Get_error_string()} on a revoked communicator")
    return RankFailedError(
        f"mpicomm: {call} on {where}: {who} ({name}); the communicator is revoked: go on with "
        "comm.shrink() (the survivors) and mpicomm.distributed.reinit_process_group", ranks, cls)


def surface(exc: BaseException, comm, call: str) -> BaseException:
    """What to raise for ``exc`` raised by ``call`` on ``comm`` (an mpicomm Communicator or an
    mpi4py communicator): a failure becomes RankFailedError after ``comm`` is revoked (so that
    every survivor leaves its calls on it); anything else is ``exc`` itself."""
    mpi_comm = getattr(comm, "mpi_comm", comm)
    if not is_failure(exc, mpi_comm):
        return exc
    if hasattr(comm, "_surface"):
        return comm._surface(exc, call)
    try:
        if not comm.Is_revoked():
            comm.Revoke()
    except MPI.Exception:  # already revoked by a peer
        pass
    return describe_failure(call, f"MPI communicator of {comm.Get_size()} ranks", exc, comm)
