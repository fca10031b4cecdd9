"""The controller behind every Horovod call on one process set.

Each call is one *round*: every rank posts a small descriptor of its call (kind, dtype, shape,
op, root, name) with a non-blocking all-gather on a control communicator, in submission order.
When a round completes, every rank holds every rank's descriptor, so every rank takes the same
decision: raise the same error (mismatched shapes, dtypes, roots, kinds, a rank that joined)
or post the data collective on a second communicator. Calls are matched by submission order
(Horovod matches by name); a call may be submitted at any time and completes when the other
ranks submit theirs, as in Horovod. ``join()`` is a rank posting JOIN rounds and taking part in
the others' allreduces with zeros until every rank has joined.

Progress is made inside the calls (submit, poll, synchronize, barrier, join): there is no
background thread.
"""
from __future__ import annotations

import zlib
from collections import deque
from typing import Callable, Generator

import numpy as np
import torch

from mpicomm.errors import CollectiveMismatchError

JOIN, ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, ERROR = 1, 2, 3, 4, 5, 6, 7
KIND_NAMES = {JOIN: "join", ALLREDUCE: "allreduce", ALLGATHER: "allgather",
              BROADCAST: "broadcast", ALLTOALL: "alltoall", REDUCESCATTER: "reducescatter",
              ERROR: "a call that failed on that rank before it was sent"}
MAX_DIMS = 8
# descriptor layout (int64): kind, dtype, ndim, shape[8], op, root, name hash, device, flag
F_KIND, F_DTYPE, F_NDIM, F_SHAPE = 0, 1, 2, 3
F_OP, F_ROOT, F_NAME, F_DEVICE, F_FLAG = 11, 12, 13, 14, 15
WIDTH = 16
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.float32, torch.float64, torch.bfloat16, torch.bool]
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}


def name_hash(name: str | None) -> int:
    """A nonzero 31-bit hash of a user-given name (0: no name given)."""
    return 0 if not name else (zlib.crc32(name.encode()) & 0x7FFFFFFF) | 1


def describe_desc(d: np.ndarray) -> str:
    kind = int(d[F_KIND])
    if kind in (JOIN, ERROR):
        return KIND_NAMES[kind]
    shape = [int(x) for x in d[F_SHAPE:F_SHAPE + int(d[F_NDIM])]]
    dev = "cuda" if d[F_DEVICE] else "cpu"
    return f"{KIND_NAMES[kind]} of {str(DTYPES[int(d[F_DTYPE])]).replace('torch.', '')} {shape} on {dev}"


class Op:
    """One call of this rank: its descriptor, and (once its round completes) the generator that
    posts its data collective(s) and produces the result."""

    kind = 0
    done = False
    error: BaseException | None = None
    result = None
    name: str | None = None

    def __init__(self, label: str, tensor: torch.Tensor | None = None, name: str | None = None,
                 op: int = 0, root: int = 0, flag: int = 0) -> None:
        self.label = label
        self.tensor = tensor
        self.name = name
        self.desc = np.zeros(WIDTH, dtype=np.int64)
        self.desc[F_KIND] = self.kind
        if tensor is not None:
            if tensor.dim() > MAX_DIMS:
                raise ValueError(f"{label}: tensors of at most {MAX_DIMS} dimensions are "
                                 f"supported (got {tensor.dim()}); reshape it first")
            if tensor.dtype not in DTYPE_CODE:
                raise TypeError(f"{label}: dtype {tensor.dtype} is not supported (expected one of "
                                f"{', '.join(str(d) for d in DTYPES)})")
            self.desc[F_DTYPE] = DTYPE_CODE[tensor.dtype]
            self.desc[F_NDIM] = tensor.dim()
            self.desc[F_SHAPE:F_SHAPE + tensor.dim()] = list(tensor.shape)
            self.desc[F_DEVICE] = 1 if tensor.is_cuda else 0
        self.desc[F_OP], self.desc[F_ROOT], self.desc[F_FLAG] = op, root, flag
        self.desc[F_NAME] = name_hash(name)
        self._gen: Generator | None = None
        self._work = None

    # -- what kinds provide ------------------------------------------------------------------

    def run(self, eng: "Engine", descs: np.ndarray) -> Generator:
        """Post the data collective(s), yielding each pending mpicomm Work; set ``result``."""
        raise NotImplementedError
        yield  # pragma: no cover

    def check(self, eng: "Engine", descs: np.ndarray) -> None:
        """Raise (the same error on every rank) when the ranks' calls cannot go together."""
        same_kind_or_fail(self, eng, descs)

    # -- the state machine -------------------------------------------------------------------

    def start(self, eng: "Engine", descs: np.ndarray) -> None:
        try:
            self.check(eng, descs)
            self._gen = self.run(eng, descs)
        except Exception as exc:  # noqa: BLE001 - the call's error, raised by synchronize()
            self._finish(exc)
            return
        self._advance()

    def _advance(self) -> None:
        try:
            self._work = next(self._gen)
        except StopIteration:
            self._finish(None)
        except Exception as exc:  # noqa: BLE001
            self._finish(exc)

    def _finish(self, error: BaseException | None) -> None:
        self.error, self.done, self._gen, self._work = error, True, None, None
        self.tensor = None

    def test(self) -> bool:
        """Advance without blocking; True when done."""
        while not self.done and self._work is not None and self._work.is_completed():
            self._complete_work()
        return self.done

    def block(self) -> None:
        """Block on the pending data collective (safe: peers post theirs without us)."""
        if not self.done and self._work is not None:
            self._complete_work()

    def _complete_work(self) -> None:
        try:
            self._work.wait()
        except Exception as exc:  # noqa: BLE001
            self._finish(exc)
            return
        self._advance()


def same_kind_or_fail(op: Op, eng: "Engine", descs: np.ndarray, joined_ok: bool = False,
                      kind: int | None = None) -> list[int]:
    """Check the round: one kind everywhere (JOIN allowed where ``joined_ok``), names agreeing.
    Returns the ranks that joined."""
    kind = op.kind if kind is None else kind
    kinds = descs[:, F_KIND]
    errs = [r for r in range(eng.size) if kinds[r] == ERROR]
    if errs:
        raise CollectiveMismatchError(
            f"{op.label}: rank(s) {errs} raised an error in the matching call before sending it "
            f"(see the error there); this call is cancelled on every rank")
    joined = [r for r in range(eng.size) if kinds[r] == JOIN]
    if joined and not joined_ok:
        raise CollectiveMismatchError(
            f"{op.label}: rank(s) {joined} have called hvd.join(); only allreduce (Sum or "
            f"Average) goes on with joined ranks, {KIND_NAMES[kind]} does not")
    others = [r for r in range(eng.size) if kinds[r] not in (JOIN, kind)]
    if others:
        calls = ", ".join(f"rank {r}: {describe_desc(descs[r])}" for r in range(eng.size))
        raise CollectiveMismatchError(
            f"{op.label}: the ranks' calls do not match ({calls}); mpicomm.horovod matches "
            "calls in the order each rank submits them, so every rank must submit the same "
            "calls in the same order")
    names = {int(descs[r, F_NAME]) for r in range(eng.size) if descs[r, F_NAME] and r not in joined}
    if len(names) > 1:
        raise CollectiveMismatchError(
            f"{op.label}: the ranks submitted differently named calls at the same point "
            f"(this rank: {op.name!r}); mpicomm.horovod matches calls in submission order, so "
            "every rank must submit the same names in the same order")
    return joined


def shapes(descs: np.ndarray, ranks) -> dict[int, list[int]]:
    return {r: [int(x) for x in descs[r, F_SHAPE:F_SHAPE + int(descs[r, F_NDIM])]] for r in ranks}


def mismatch(op: Op, what: str, descs: np.ndarray, ranks) -> CollectiveMismatchError:
    calls = ", ".join(f"rank {r}: {describe_desc(descs[r])}" for r in ranks)
    return CollectiveMismatchError(f"{op.label}: mismatched {what} across ranks ({calls})")


class Engine:
    """The rounds of one process set (control and data communicators, the calls in flight)."""

    def __init__(self, comm) -> None:
        self.comm = comm                                # the set's mpicomm Communicator
        self.rank, self.size = comm.rank, comm.size
        # duplicates in the set's family: a revoke (ULFM) of one reaches them all
        self._ctrl, self._fence = comm.dup(), comm.dup()
        self.ctrl = self._ctrl.mpi_comm                 # descriptors (mpi4py)
        self.fence = self._fence.mpi_comm               # barriers (mpi4py)
        self.data = comm.dup()                          # data collectives (mpicomm)
        self.queue: deque = deque()                     # rounds posted, not yet decided
        self.flight: list[Op] = []                      # data posted, not yet complete
        self.names: dict[str, Op] = {}
        self.rounds = 0
        self.join_round: dict[int, int] = {}            # rank -> round it first appeared joined

    def submit(self, op: Op) -> Op:
        """Post ``op``'s round (never blocks). A name still in flight raises ValueError."""
        if op.name is not None:
            held = self.names.get(op.name)
            if held is not None and not held.done:
                raise ValueError(f"{op.label}: the name {op.name!r} is already used by a call "
                                 "still in flight; wait for it (hvd.synchronize) or use another name")
            self.names[op.name] = op
        recv = np.empty((self.size, WIDTH), dtype=np.int64)
        op._recv = recv
        op._req = self.ctrl.Iallgather(op.desc, recv)
        self.queue.append(op)
        return op

    def progress(self) -> bool:
        """Decide every completed round, advance the data in flight; True if anything moved."""
        moved = False
        while self.queue and self.queue[0]._req.Test():
            self._decide(self.queue.popleft())
            moved = True
        if self.flight:
            still = []
            for op in self.flight:
                if op.test():
                    moved = True
                    self._release(op)
                else:
                    still.append(op)
            self.flight = still
        return moved

    def _decide(self, op: Op) -> None:
        self.rounds += 1
        descs = op._recv
        for r in range(self.size):
            if descs[r, F_KIND] == JOIN:
                self.join_round.setdefault(r, self.rounds)
        op.start(self, descs)
        if op.done:
            self._release(op)
        else:
            self.flight.append(op)

    def _release(self, op: Op) -> None:
        if op.name is not None and self.names.get(op.name) is op:
            del self.names[op.name]

    def pending(self) -> bool:
        return bool(self.queue or self.flight)

    def block_once(self, op: Op) -> None:
        """Block until something ``op`` waits for moves: the oldest round, or op's data."""
        if self.queue:
            self.queue[0]._req.Wait()
        elif not op.done:
            op.block()

    def drain(self) -> None:
        """Complete every call in flight (their errors stay with their handles)."""
        while self.pending():
            if not self.progress():
                if self.queue:
                    self.queue[0]._req.Wait()
                elif self.flight:
                    self.flight[0].block()

    def free(self, collective: bool = True) -> None:
        """Cancel what is left and release the communicators (``collective=False``: after a
        rank failure, only drop them)."""
        for op in list(self.queue) + self.flight:
            if not op.done:
                op._finish(RuntimeError(f"{op.label}: hvd.shutdown() or remove_process_set() "
                                        "cancelled this call"))
        self.queue.clear()
        self.flight.clear()
        if collective:
            for c in (self._ctrl, self._fence, self.data):
                c.free()


def wait_for(ops: list[Op], engines: Callable[[], list[Engine]]) -> None:
    """Block until every op is done, advancing every engine (no rank waits on a stalled peer)."""
    spins = 0
    while not all(op.done for op in ops):
        busy = [e for e in engines() if e.pending()]
        moved = False
        for e in busy:
            moved |= e.progress()
        if all(op.done for op in ops):
            return
        if len(busy) == 1:
            target = next(op for op in ops if not op.done)
            busy[0].block_once(target)
            busy[0].progress()
            continue
        spins = 0 if moved else spins + 1
        if spins > 200:
            import time
            time.sleep(min(1e-3, 1e-6 * spins))
