"""Steps of a collective save or load: run on rank 0 or on every rank, fail on every rank together.

Every ckpt entry point (``save``, ``load``, ``from_deepspeed``, ``to_deepspeed_universal``, the
CLI) runs its steps through one ``Collective``. A step that raises on any rank raises the same
exception on every rank: each failing rank sends only its rank, the exception's type name,
its nearest built-in base and its message (never the exception object), so an exception that
cannot be pickled cannot leave the other ranks waiting. The exception raised everywhere is
rebuilt from the lowest failing rank's report: the same ckpt class for a ``CheckpointError``
(so its ``exit_code`` holds on every rank), else a ``StepFailedError`` that is also an instance
of the built-in base (``OSError``, ``MemoryError``...). Its ``failures`` list every rank's
report. In a one-rank job the step's own exception is raised unchanged. A rank failure (ULFM)
is no step failure: it raises ``mpicomm.RankFailedError`` at once, on every survivor (the
communicator revoked), with no agreement among ranks that may be dead.
"""
from __future__ import annotations

import builtins
import pickle
from typing import Any, Callable, TypeVar

from mpi4py import MPI

from mpicomm.faults import RankFailedError, surface

from .errors import CheckpointError, FailureReport, StepFailedError

T = TypeVar("T")

_Report = tuple[int, str, str, str]  # rank, type name, built-in base name, message
_MIXED: dict[type, type] = {}
MAX_LISTED = 8


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails still gets reported
        return f"<{type(exc).__name__} with an unprintable message>"


def _builtin_base(exc: BaseException) -> str:
    for cls in type(exc).__mro__:
        if getattr(builtins, cls.__name__, None) is cls:
            return cls.__name__
    return "Exception"


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _checkpoint_classes() -> dict[str, type]:
    found: dict[str, type] = {}
    todo = [CheckpointError]
    while todo:
        cls = todo.pop()
        if cls not in _MIXED.values():
            found[_type_name(cls)] = cls
        todo.extend(cls.__subclasses__())
    return found


def _mixed(base: type) -> type:
    """A StepFailedError that is also a ``base`` (a built-in exception class)."""
    cls = _MIXED.get(base)
    if cls is None:
        name = f"StepFailedError[{base.__name__}]"
        cls = type(name, (StepFailedError, base), {"__module__": __name__, "__qualname__": name})
        _MIXED[base] = cls
    return cls


def rebuild(what: str, size: int, reports: list[_Report]) -> CheckpointError:
    """The exception that every rank raises for the failure ``reports`` (in rank order)."""
    failures = tuple(FailureReport(r, t.rsplit(".", 1)[-1], m) for r, t, _b, m in reports)
    if len(failures) == 1:
        f = failures[0]
        text = f"{what} failed on rank {f.rank} of {size}: {f.type_name}: {f.message}"
    else:
        listed = "; ".join(str(f) for f in failures[:MAX_LISTED])
        more = f"; and {len(failures) - MAX_LISTED} more" if len(failures) > MAX_LISTED else ""
        text = f"{what} failed on {len(failures)} of {size} ranks: {listed}{more}"
    _rank, type_name, base_name, _msg = reports[0]
    cls = _checkpoint_classes().get(type_name)
    if cls is None:
        base = getattr(builtins, base_name, None)
        ok = isinstance(base, type) and issubclass(base, Exception) and base is not Exception
        cls = _mixed(base) if ok else StepFailedError
    try:
        exc = cls(text)
    except Exception:  # noqa: BLE001 - a class that needs other arguments: the plain error
        exc = StepFailedError(text)
    exc.failures = failures
    return exc


class Collective:
    """Run the steps of one collective operation (``what``, e.g. "save") over ``comm``."""

    def __init__(self, comm: Any, what: str) -> None:
        self.comm = comm
        self.mpi = getattr(comm, "mpi_comm", comm)
        self.what = what
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()

    def _failure(self, exc: BaseException, step: str) -> BaseException | None:
        """A rank failure (ULFM) as the RankFailedError to raise at once (the communicator is
        revoked: no rank waits in a later step); None for any other error."""
        if isinstance(exc, RankFailedError):
            return exc
        err = surface(exc, self.comm, f"{self.what} ({step})")
        return err if isinstance(err, RankFailedError) else None

    def _mpi(self, step: str, call: Callable[[], T], local: BaseException | None = None) -> T:
        """``call()`` (an MPI call on the communicator), a rank failure raised as RankFailedError."""
        try:
            return call()
        except MPI.Exception as exc:
            failed = self._failure(exc, step)
            if failed is None:
                raise
            raise failed from (local or exc)

    def _report(self, exc: BaseException) -> _Report:
        return (self.rank, _type_name(type(exc)), _builtin_base(exc), _message(exc))

    def _raise(self, step: str, reports: list[_Report], local: BaseException | None) -> None:
        exc = rebuild(f"{self.what} ({step})", self.size, reports)
        raise exc from local

    def everywhere(self, step: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if it raises on any rank, raise on every rank."""
        local: BaseException | None = None
        report = None
        value: Any = None
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            local, report = exc, self._report(exc)
            failed = self._failure(exc, step)
            if failed is not None:  # every survivor raises it too: nothing to agree on
                raise failed from (None if failed is exc else exc)
        if self.size == 1:
            if local is not None:
                raise local
            return value
        reports = [r for r in self._mpi(step, lambda: self.mpi.allgather(report), local)
                   if r is not None]
        if reports:
            self._raise(step, reports, local)
        return value

    def on_root(self, step: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 and return its result on every rank; if it raises (or its result
        cannot be sent), raise on every rank."""
        if self.size == 1:
            return fn()
        local: BaseException | None = None
        payload = b""
        if self.rank == 0:
            try:
                payload = pickle.dumps((True, fn()))
            except Exception as exc:  # noqa: BLE001 - raised below, on every rank
                failed = self._failure(exc, step)
                if failed is not None:
                    raise failed from (None if failed is exc else exc)
                local = exc
                payload = pickle.dumps((False, self._report(exc)))
        ok, value = pickle.loads(self._mpi(step, lambda: self.mpi.bcast(payload, root=0), local))
        if not ok:
            self._raise(step, [value], local)
        return value

    def gather(self, value: Any) -> list[Any] | None:
        """``value`` of every rank, in rank order, on rank 0 (None elsewhere)."""
        return self._mpi("gather", lambda: self.mpi.gather(value, root=0))

    def reduce_xor(self, arr: Any) -> Any:
        """The element-wise XOR of every rank's numpy integer array ``arr`` (one shape everywhere),
        on rank 0 (``arr`` itself elsewhere); a fixed-size reduction, whatever the rank count."""
        return self._reduce(arr, "BXOR")

    def reduce_sum(self, arr: Any) -> Any:
        """The element-wise sum of every rank's numpy array ``arr``, on rank 0 (``arr`` elsewhere)."""
        return self._reduce(arr, "SUM")

    def _reduce(self, arr: Any, op: str) -> Any:
        if self.size == 1:
            return arr
        from mpi4py import MPI

        out = arr.copy() if self.rank == 0 else arr
        self._mpi(f"reduce {op}", lambda: self.mpi.Reduce(
            MPI.IN_PLACE if self.rank == 0 else arr, out if self.rank == 0 else None,
            op=getattr(MPI, op), root=0))
        return out

    def allgather(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order, on every rank."""
        return self._mpi("allgather", lambda: self.mpi.allgather(value))
