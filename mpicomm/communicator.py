"""The Communicator: torch.distributed-style collectives on one MPI communicator.

Every collective follows the same path: validate the arguments (errors raised before any MPI
call), optionally agree across ranks (checking mode), adapt each buffer for MPI (zero-copy when
possible; otherwise contiguous, upcast or staged copies), call MPI's blocking or non-blocking
primitive, and put results back into the caller's buffers when the call completes. The calls
live by job: ``reductions`` (all_reduce, reduce, reduce_scatter_tensor), ``moves`` (broadcast,
gathers, scatter, all-to-all) and ``p2p`` (send and receive), mixins on the launch path here;
``fastpath`` puts its rule in front of the blocking calls on plain host tensors.
"""
from __future__ import annotations

import functools
import warnings
import weakref
from typing import Callable, NoReturn, Sequence

from mpi4py import MPI

from . import fastpath, faults, reduce16
from accelerators.flags import env_flag
from .buffers import IN, Slot
from .device_paths import DevicePolicy
from .errors import check_type, fail_value
from .moves import Moves
from .observe import log_init, observed
from .p2p import PointToPoint
from .reductions import Reductions
from .work import Work

_world: "Communicator | None" = None


def faults_surfaced(method: Callable) -> Callable:
    """Raise a rank failure inside ``method`` as RankFailedError (see Communicator._surface)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except MPI.Exception as exc:
            self._raise_surfaced(exc, method.__name__)
    return call


def _node_rank(mpi_comm: MPI.Intracomm, node_group: MPI.Group | None = None) -> tuple[int, int, MPI.Group]:
    """(local rank, ranks of ``mpi_comm`` on this node, the node's processes), local rank as the
    accelerator layer says.

    Launcher variable first, the shared-memory split as the fallback (collective over
    ``mpi_comm``; with ``node_group``, the processes known to share this node, no collective:
    for a communicator made by a shrink, which a rank may fail right after); on the world, a
    warning when the node's local ranks are not each of 0..n-1.
    """
    from accelerators import LocalRankWarning, detect_local_rank, get_accelerator
    from accelerators.local_rank import numbering_problem

    acc = get_accelerator()
    if node_group is not None:
        everyone = mpi_comm.Get_group()
        here = MPI.Group.Translate_ranks(node_group, list(range(node_group.Get_size())), everyone)
        ranks = sorted(r for r in here if r != MPI.UNDEFINED)
        split = (ranks.index(mpi_comm.Get_rank()), len(ranks))
        local = detect_local_rank(explicit=acc._explicit_local_rank, shared_split=lambda: split)
        return local.rank, split[1], everyone.Incl(ranks)
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        if MPI.Comm.Compare(mpi_comm, MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT):
            local = acc.local_rank()
            problem = numbering_problem(node.allgather(local.rank), local.source)
            if problem is not None:
                warnings.warn(problem, LocalRankWarning, stacklevel=3)
        else:  # the launcher's answer (per process) when there is one, else this split, never
               # a collective over the world (not every world rank is here)
            local = detect_local_rank(explicit=acc._explicit_local_rank,
                                      shared_split=lambda: (node.Get_rank(), node.Get_size()))
        return local.rank, node.Get_size(), node.Get_group()
    finally:
        node.Free()


class Communicator(Reductions, Moves, PointToPoint):
    """Collectives over torch tensors, numpy and cupy arrays on one MPI communicator.

    ``check=True`` (or ``MPICOMM_CHECK=1``) makes the ranks agree on each collective's op,
    shapes, dtypes and root before calling MPI, so a mismatch raises on every rank instead of
    hanging or corrupting data.

    ``local_rank`` is this process's rank on its node as the accelerator layer numbers it
    (launcher variable first, shared-memory split as the fallback; it picks the device);
    ``local_size`` counts this communicator's ranks on the node.
    """

    def __init__(self, mpi_comm: MPI.Comm = MPI.COMM_WORLD, check: bool | None = None,
                 _node: MPI.Group | None = None) -> None:
        check_type("Communicator", "mpi_comm", mpi_comm, "an mpi4py intracommunicator",
                   ok=isinstance(mpi_comm, MPI.Intracomm) and mpi_comm != MPI.COMM_NULL)
        faults.fault_tolerant()    # raises where a death could hang this job (mpicomm.ft_env.too_late)
        self.mpi_comm = mpi_comm
        mpi_comm.Set_errhandler(MPI.ERRORS_RETURN)  # failures come back as errors, never abort
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        # (the processes on this node: a shrink numbers its ranks on the node from them)
        self.local_rank, self.local_size, self._node = _node_rank(mpi_comm, _node)
        self.check: bool = env_flag("MPICOMM_CHECK") if check is None else bool(check)
        self._policy: DevicePolicy | None = None
        self._tag_ub: int = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self._r16: reduce16.State | None = None
        self._last_fast: tuple = fastpath.NOT_YET_FAST
        self._last_bcast: tuple = fastpath.NOT_YET_BCAST
        self._last_gather: tuple = fastpath.NOT_YET_GATHER
        self._last_scatter: tuple = fastpath.NOT_YET_SCATTER
        # this communicator and those split or duplicated from it (or it from them): a failure
        # seen on one revokes them all, so that no rank stays in a call on a relative (the
        # hierarchical paths run on a node and a cross-node communicator of one parent)
        self._family: weakref.WeakSet = weakref.WeakSet([self])

    def _adopt(self, child: "Communicator | None") -> "Communicator | None":
        """Make ``child`` (split or duplicated from this one) a member of this family."""
        if child is not None:
            self._family.add(child)
            child._family = self._family
        return child

    def __repr__(self) -> str:
        return f"<mpicomm.Communicator rank {self.rank} of {self.size}>"

    # -- plumbing ---------------------------------------------------------------------------

    def device_policy(self) -> DevicePolicy:
        """Which MPI calls take device buffers directly (decided once, on first device buffer)."""
        if self._policy is None:
            self._policy = DevicePolicy.detect()
        return self._policy

    def _launch(self, blocking: Callable, nonblocking: Callable, args: tuple, slots: Sequence[Slot],
                async_op: bool, result: Sequence, extra: Sequence[Callable[[], None]] = ()):
        """Run one MPI primitive (blocking or not) and put the results back on completion."""
        finish = [s.finish for s in slots if s.has_finish]
        finish.extend(extra)
        try:
            if async_op:
                return Work(nonblocking(*args), finish, result, keep=slots, comm=self)
            blocking(*args)
        except BaseException:
            for s in slots:
                s.role = IN  # release staging memory without writing anything back
                s.finish()
            raise
        for step in finish:
            step()
        return None

    # -- synchronisation and groups ---------------------------------------------------------

    @observed
    def barrier(self, async_op: bool = False) -> Work | None:
        """Wait until every rank has entered the barrier."""
        return self._launch(self.mpi_comm.Barrier, self.mpi_comm.Ibarrier, (), [], async_op, [])

    @faults_surfaced
    def split(self, color: int | None, key: int = 0) -> "Communicator | None":
        """Sub-communicator of the ranks passing the same ``color`` (None: not a member), ordered by ``key``."""
        if color is not None and (not isinstance(color, int) or color < 0):
            fail_value("split", "color", "a non-negative int or None", repr(color))
        sub = self.mpi_comm.Split(MPI.UNDEFINED if color is None else color, key)
        if sub == MPI.COMM_NULL:
            return None
        return self._adopt(Communicator(sub, check=self.check))

    @faults_surfaced
    def split_node(self) -> "Communicator":
        """Sub-communicator of this communicator's ranks on this rank's node (shared memory,
        ``MPI_COMM_TYPE_SHARED``), in this communicator's rank order. Collective."""
        return self._adopt(Communicator(self.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, self.rank),
                                        check=self.check))

    @faults_surfaced
    def dup(self) -> "Communicator":
        """A communicator over the same ranks with its own message space."""
        return self._adopt(Communicator(self.mpi_comm.Dup(), check=self.check))

    # -- rank failures (ULFM) ---------------------------------------------------------------

    @property
    def fault_tolerant(self) -> bool:
        """Whether a peer's death raises :class:`mpicomm.RankFailedError` here instead of ending
        the job (Open MPI with ULFM, launched with ``mpirun --with-ft ulfm``)."""
        return faults.fault_tolerant()

    def _mpi_comms(self) -> list:
        """This communicator's MPI communicators: its own, then the private ones of its calls."""
        comms = [self.mpi_comm]
        if self._r16 is not None and self._r16._comm is not None:
            comms.append(self._r16._comm)
        return comms

    def _surface(self, exc: BaseException, call: str) -> BaseException:
        """What to raise for ``exc`` from ``call``: a failure becomes RankFailedError, after this
        communicator is revoked (so that every survivor leaves its calls on it); else ``exc``."""
        if not faults.is_failure(exc, self.mpi_comm):
            return exc
        self._revoke_quietly()
        return faults.describe_failure(call, repr(self), exc, self.mpi_comm)

    def _raise_surfaced(self, exc: BaseException, call: str) -> NoReturn:
        """Raise what :meth:`_surface` makes of ``exc`` (``exc`` itself unless a rank failed)."""
        err = self._surface(exc, call)
        if err is exc:
            raise exc
        raise err from exc

    def _revoke_quietly(self) -> None:
        """Revoke this communicator and its family (see ``__init__``), as far as MPI lets."""
        for member in list(self._family):
            for comm in member._mpi_comms():
                try:
                    if comm != MPI.COMM_NULL and not comm.Is_revoked():
                        comm.Revoke()
                except MPI.Exception:  # already revoked by a peer, or being revoked
                    pass

    def revoke(self) -> None:
        """Revoke the communicator (ULFM): every pending and later call on it, on every rank,
        fails with :class:`mpicomm.RankFailedError`; so on the communicators split or
        duplicated from it (or it from). Local; :meth:`shrink` still works."""
        faults.require("Communicator.revoke()")
        self._revoke_quietly()

    @property
    def revoked(self) -> bool:
        """Whether this communicator was revoked (here or by a peer); False without ULFM."""
        return faults.fault_tolerant() and self.mpi_comm.Is_revoked()

    def failed_ranks(self) -> tuple[int, ...]:
        """The ranks of this communicator known here to have failed, sorted (local)."""
        faults.require("Communicator.failed_ranks()")
        return faults.failed_ranks(self.mpi_comm)

    def shrink(self) -> "Communicator":
        """A new Communicator of the surviving ranks, renumbered in this communicator's order
        (ULFM's MPI_Comm_shrink; collective over the survivors, works on a revoked one)."""
        faults.require("Communicator.shrink()")
        try:
            new = self.mpi_comm.Shrink()
        except MPI.Exception as exc:
            raise RuntimeError(f"mpicomm: shrink() of {self!r} failed: {exc}") from exc
        return Communicator(new, check=self.check, _node=self._node)

    def agree(self, flag: bool, every_rank: bool = False) -> bool:
        """The AND of ``flag`` over the surviving ranks, the same on every survivor, even when
        ranks fail during the call (ULFM's MPI_Comm_agree; collective over the survivors).
        ``every_rank``: False too where a rank of this communicator failed, before or during
        the call (it did not take part)."""
        return bool(self.agree_bits(1 if flag else 0, every_rank) & 1)

    def agree_bits(self, bits: int, every_rank: bool = False) -> int:
        """The bitwise AND of the non-negative int ``bits`` over the surviving ranks, as ``agree``
        (``every_rank``: 0 where a rank failed)."""
        faults.require("Communicator.agree()")
        return faults.agree(self.mpi_comm, bits, repr(self), every_rank)

    def free(self) -> None:
        """Release the MPI communicator (not for the world communicator)."""
        self._family.discard(self)
        if self._r16 is not None:
            self._r16.free()
        if self.mpi_comm not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self.mpi_comm.Free()


def init(check: bool | None = None) -> Communicator:
    """Return the world communicator, creating it on first use (idempotent)."""
    global _world
    if _world is None:
        _world = Communicator(MPI.COMM_WORLD, check=check)
        log_init(_world)
    elif check is not None:
        _world.check = bool(check)
    return _world


def as_communicator(comm: "Communicator | MPI.Comm | None" = None) -> Communicator:
    """The Communicator for ``comm``: None is the world; an mpi4py intracommunicator is wrapped.

    Wrapping an mpi4py communicator other than ``MPI.COMM_WORLD`` is collective over it (the
    Communicator learns its node-local ranks); ``MPI.COMM_WORLD`` maps to :func:`init`'s world.
    """
    if comm is None:
        return init()
    if isinstance(comm, Communicator):
        return comm
    if isinstance(comm, MPI.Intracomm) and comm != MPI.COMM_NULL:
        if comm == MPI.COMM_WORLD:
            return init()
        return Communicator(comm)
    raise TypeError(f"comm: expected None (the world), an mpicomm.Communicator or an mpi4py "
                    f"intracommunicator, got {type(comm).__name__}")


def get_world() -> Communicator:
    """The world communicator created by init()."""
    if _world is None:
        raise RuntimeError("mpicomm: call mpicomm.init() before using the module-level collectives")
    return _world


def is_initialized() -> bool:
    """Whether init() has created the world communicator."""
    return _world is not None
