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

import warnings
from typing import Callable, Sequence

from mpi4py import MPI

from . import fastpath, reduce16
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


def _node_rank(mpi_comm: MPI.Intracomm) -> tuple[int, int]:
    """(local rank, ranks of ``mpi_comm`` on this node), local rank as the accelerator layer says.

    Launcher variable first, the shared-memory split as the fallback (collective over
    ``mpi_comm``); on the world, a warning when the node's local ranks are not each of 0..n-1.
    """
    from accelerators import LocalRankWarning, detect_local_rank, get_accelerator
    from accelerators.local_rank import numbering_problem

    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        acc = get_accelerator()
        if MPI.Comm.Compare(mpi_comm, MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT):
            local = acc.local_rank()
            problem = numbering_problem(node.allgather(local.rank), local.source)
            if problem is not None:
                warnings.warn(problem, LocalRankWarning, stacklevel=3)
        else:  # the launcher's answer (per process) when there is one, else this split, never
               # a collective over the world (not every world rank is here)
            local = detect_local_rank(explicit=acc._explicit_local_rank,
                                      shared_split=lambda: (node.Get_rank(), node.Get_size()))
        return local.rank, node.Get_size()
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

    def __init__(self, mpi_comm: MPI.Comm = MPI.COMM_WORLD, check: bool | None = None) -> None:
        check_type("Communicator", "mpi_comm", mpi_comm, "an mpi4py intracommunicator",
                   ok=isinstance(mpi_comm, MPI.Intracomm) and mpi_comm != MPI.COMM_NULL)
        self.mpi_comm = mpi_comm
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        self.local_rank, self.local_size = _node_rank(mpi_comm)
        self.check: bool = env_flag("MPICOMM_CHECK") if check is None else bool(check)
        self._policy: DevicePolicy | None = None
        self._tag_ub: int = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self._r16: reduce16.State | None = None
        self._last_fast: tuple = fastpath.NOTHING_REMEMBERED
        self._last_bcast: tuple = fastpath.NOTHING_REMEMBERED
        self._last_gather: tuple = fastpath.NOTHING_REMEMBERED
        self._last_scatter: tuple = fastpath.NOTHING_REMEMBERED

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
                return Work(nonblocking(*args), finish, result, keep=slots)
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

    def split(self, color: int | None, key: int = 0) -> "Communicator | None":
        """Sub-communicator of the ranks passing the same ``color`` (None: not a member), ordered by ``key``."""
        if color is not None and (not isinstance(color, int) or color < 0):
            fail_value("split", "color", "a non-negative int or None", repr(color))
        sub = self.mpi_comm.Split(MPI.UNDEFINED if color is None else color, key)
        if sub == MPI.COMM_NULL:
            return None
        return Communicator(sub, check=self.check)

    def split_node(self) -> "Communicator":
        """Sub-communicator of this communicator's ranks on this rank's node (shared memory,
        ``MPI_COMM_TYPE_SHARED``), in this communicator's rank order. Collective."""
        return Communicator(self.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, self.rank), check=self.check)

    def dup(self) -> "Communicator":
        """A communicator over the same ranks with its own message space."""
        return Communicator(self.mpi_comm.Dup(), check=self.check)

    def free(self) -> None:
        """Release the MPI communicator (not for the world communicator)."""
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
