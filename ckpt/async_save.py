"""Asynchronous saves: snapshot into reused host memory, then write, checksum and commit in a
background thread on a duplicated communicator; at most one save in flight per communicator."""
from __future__ import annotations

import copy
import datetime
import threading
from typing import Any, Callable

import torch
from mpi4py import MPI

from accelerators import get_accelerator
from mpicomm.faults import fault_tolerant
from mpicomm.work import BaseWork, WaitTimeoutError, timeout_seconds

from .collective import Collective
from .errors import CheckpointError
from .io import byte_view
from .manifest import Manifest
from .optimizers import OptimizerPlanner

ALIGN = 64


class AsyncSaveError(CheckpointError, RuntimeError):
    """An asynchronous save cannot start (e.g. MPI lacks MPI_THREAD_MULTIPLE)."""


class SnapshotPool:
    """Host memory that a save's buffers are copied into, kept and reused across saves (its
    pages are touched once, when it grows), so a snapshot costs one memory copy."""

    def __init__(self) -> None:
        self.arena = torch.empty(0, dtype=torch.uint8)

    def reserve(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Flat uint8 host tensors in the pool, one per buffer (contiguous; any device), to copy
        them into."""
        sizes = [b.numel() * b.element_size() for b in buffers]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // ALIGN) * ALIGN
        if total > self.arena.numel():
            self.arena = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self.arena = torch.zeros(total + total // 8, dtype=torch.uint8)  # zeros: touch every page now
        return [self.arena[off:off + n] for off, n in zip(offsets, sizes)]

    def release(self) -> None:
        """Drop the memory (freed once no snapshot of it is referenced)."""
        self.arena = torch.empty(0, dtype=torch.uint8)

    def snapshot(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``buffers`` (contiguous; any device) as flat uint8 host tensors in the pool."""
        out = self.reserve(buffers)
        copy_into(out, buffers)
        return out


def copy_into(dsts: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
    """Copy each buffer's bytes into its host tensor (waiting for device copies to finish)."""
    for dst, b in zip(dsts, buffers):
        dst.copy_(byte_view(b))
    acc = get_accelerator()
    if any(acc.is_device_buffer(b) for b in buffers):
        acc.synchronize()


def _storage(t: torch.Tensor) -> int:
    from . import dtensor

    if dtensor.is_dtensor(t):
        t = dtensor.local(t)
    return t.untyped_storage().data_ptr()


def updated_by_step(buffers: list[torch.Tensor], model: torch.nn.Module, opt: OptimizerPlanner) -> dict[int, str]:
    """Index -> name of the ``buffers`` that share memory with a tensor the optimizer's ``step``
    changes: the model's parameters, and what the optimizer planner names (``stepped_tensors``)."""
    out: dict[int, str] = {}
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
        out.setdefault(_storage(p), f"parameter {name!r}")
    for t, what in opt.stepped_tensors(names):
        out.setdefault(_storage(t), what)
    return {i: out[at] for i, b in enumerate(buffers) if (at := _storage(b)) in out}


def _version(t: torch.Tensor, name: str) -> int:
    """``t``'s version counter (moved by every in-place change made through it)."""
    if t.is_inference():
        raise CheckpointError(f"save(snapshot='background'): {name} is an inference tensor, which has no version "
                              "counter to tell whether it changed before the background copy; use snapshot='now'")
    return t._version


class BackgroundSnapshot:
    """The part of a snapshot taken after ``save`` returns: the buffers that only the optimizer's
    ``step`` changes (parameters, optimizer state), copied first thing in the background thread.
    The optimizer's step waits for it (a step pre-hook); a buffer changed before it was copied
    (its version counter moved) fails the save on every rank."""

    def __init__(self, dsts: list[torch.Tensor], buffers: list[torch.Tensor], names: list[str],
                 versions: list[int], optimizer: torch.optim.Optimizer) -> None:
        self.dsts, self.buffers, self.names, self.versions = dsts, buffers, names, versions
        self.copied = threading.Event()
        self._hook = optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, *_: Any) -> None:
        self.copied.wait()

    def take(self) -> None:
        """Copy the buffers (background thread); raise if one changed before it was copied."""
        try:
            copy_into(self.dsts, self.buffers)
            changed = [n for n, b, v in zip(self.names, self.buffers, self.versions) if b._version != v]
        finally:
            self.copied.set()
        if changed:
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            raise CheckpointError(
                f"save(snapshot='background'): {', '.join(changed[:3])}{more} changed after save() returned and "
                "before the background snapshot copied it; nothing was written. Change parameters and optimizer "
                "state only through the optimizer's step() (it waits for the snapshot), or call "
                "handle.wait_snapshot() first.")

    def release(self) -> None:
        """Remove the step pre-hook (on the caller's thread, never from inside a step)."""
        self._hook.remove()


class SaveHandle(BaseWork):
    """A save in flight, a ``mpicomm`` work handle: ``wait(timeout)`` returns its Manifest (or
    raises its failure, the same on every rank; :class:`mpicomm.WaitTimeoutError` if it is still
    writing then), ``is_completed()`` tells without waiting, ``get_future()`` is completed with
    the Manifest (``result()`` returns it)."""

    def __init__(self, fn: Callable[[], Manifest], name: str,
                 background: BackgroundSnapshot | None = None) -> None:
        super().__init__()
        self._result = None  # type: ignore[assignment]  # the Manifest once committed
        self._event = threading.Event()  # only the save's thread settles: waiters wait for it
        self._reported = False
        self._background = background
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def snapshot_done(self) -> bool:
        """True once the save no longer reads the caller's tensors (at return unless
        ``snapshot='background'``)."""
        return self._background is None or self._background.copied.is_set() or self._done

    def wait_snapshot(self, timeout: float | datetime.timedelta | None = None) -> None:
        """Block until the save no longer reads the caller's tensors (they may then change);
        ``timeout`` as for ``wait``."""
        limit = timeout_seconds(timeout)
        if self._background is not None and not self._background.copied.wait(limit):
            raise WaitTimeoutError(f"ckpt: the background snapshot did not complete within "
                                   f"wait_snapshot(timeout={limit:g} s); it goes on")

    def _run(self, fn: Callable[[], Manifest]) -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - kept for wait(), raised on the caller's thread
            error = exc
        with self._lock:
            self._result = result  # type: ignore[assignment]
            self._settle(error)

    def _test(self) -> bool:
        return self._done

    def _describe(self) -> str:
        return "the asynchronous save"

    def wait(self, timeout: float | datetime.timedelta | None = None) -> Manifest:  # type: ignore[override]
        """Block until the save has committed and return its manifest; a failure (the same on
        every rank) is raised here. With ``timeout`` (seconds or a timedelta; None or 0: no
        limit), raise :class:`mpicomm.WaitTimeoutError` if it is still writing then."""
        try:
            super().wait(timeout)
        except WaitTimeoutError:
            raise
        except BaseException:
            self._finish()
            raise
        self._finish()
        return self._result  # type: ignore[return-value]

    def result(self) -> Manifest:  # type: ignore[override]
        """The manifest (waits for the commit)."""
        return self.wait()

    def _finish(self) -> None:
        """After completion: the thread ended, the step pre-hook removed, the failure reported."""
        if threading.current_thread() is not self._thread:  # a future's callback may wait too
            self._thread.join()
        if self._background is not None:
            self._background.release()
            self._background = None
        self._reported = True

    def _settle_pending(self) -> None:
        """Wait; raise the failure unless it was raised already."""
        reported = self._reported
        try:
            self.wait()
        except BaseException:
            if not reported:
                raise

    def __repr__(self) -> str:
        return f"<ckpt.SaveHandle {'completed' if self._done else 'pending'}>"


class _Slot:
    """Per communicator: its duplicate for background I/O, the snapshot pool, the save in flight."""

    def __init__(self, comm: Any) -> None:
        self.source = comm.mpi_comm  # held, so that its id (the slot's key) is never reused
        self.dup = comm.dup()
        self.pool = SnapshotPool()
        self.pending: SaveHandle | None = None

    def dead(self) -> bool:
        """Whether its communicator was freed, or revoked after a rank failure (ULFM): no save
        on it can run again."""
        if self.source == MPI.COMM_NULL:
            return True
        if not fault_tolerant():
            return False
        try:
            return bool(self.source.Is_revoked())
        except MPI.Exception:  # noqa: BLE001 - a communicator MPI no longer answers for
            return True

    def free(self) -> None:
        """Free the duplicate and the snapshot memory (once the save in flight, if any, ended)."""
        if self.pending is not None:
            self.pending._finish()  # its thread joined, its step pre-hook removed
            self.pending = None
        try:
            self.dup.free()  # local on a revoked communicator
        except MPI.Exception:  # noqa: BLE001 - nothing more to give back
            pass
        self.pool.release()


_SLOTS: dict[int, _Slot] = {}
_LOCK = threading.Lock()


def _key(comm: Any) -> int:
    return id(comm.mpi_comm)


def wait_pending(comm: Any = None) -> None:
    """Wait for the asynchronous save in flight on ``comm`` (None: on every communicator) and
    raise its failure if it failed and the failure was not raised yet."""
    with _LOCK:
        slots = list(_SLOTS.values()) if comm is None else [s for k, s in _SLOTS.items() if k == _key(comm)]
    for slot in slots:
        handle = slot.pending
        if handle is not None:
            slot.pending = None
            handle._settle_pending()


def release_dead() -> int:
    """Free the slots (duplicate communicator, snapshot memory) of the communicators that were
    freed or revoked after a rank failure and have no save running; returns how many. A
    recovery calls it once the save in flight when a rank failed has ended: the survivors save
    on a new communicator from then on."""
    with _LOCK:
        gone = [k for k, s in _SLOTS.items() if s.dead() and (s.pending is None or s.pending._done)]
        slots = [_SLOTS.pop(k) for k in gone]
    for slot in slots:
        slot.free()
    return len(slots)


def slot_for(comm: Any) -> _Slot:
    """This communicator's slot, its duplicate made at first use (collective: every rank of
    ``comm`` calls save together). Refuses when MPI cannot run I/O in a second thread."""
    level = MPI.Query_thread()
    if level < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                 MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
        raise AsyncSaveError(
            f"save(async_save=True) writes from a background thread and needs MPI_THREAD_MULTIPLE; MPI was "
            f"initialised with {names.get(level, level)} (mpi4py asks for MULTIPLE unless mpi4py.rc.thread_level "
            "says otherwise). Use async_save=False.")
    key = _key(comm)
    with _LOCK:
        slot = _SLOTS.get(key)
    if slot is None:
        slot = _Slot(comm)
        with _LOCK:
            _SLOTS[key] = slot
    return slot


def start(comm: Any, run: Any, buffers: list[torch.Tensor], manifest: Manifest,
          finish: Callable[[Any, list[torch.Tensor], Manifest], Manifest],
          later: dict[int, str] | None = None, optimizer: torch.optim.Optimizer | None = None) -> SaveHandle:
    """Snapshot ``buffers`` and the manifest on every rank (raising on every rank if any rank
    fails), then run ``finish(dup_comm, snapshot, manifest)`` in the background.

    ``later`` (buffer index -> name): buffers copied in the background instead, before
    ``finish``; ``optimizer.step`` waits for that copy."""
    slot = slot_for(comm)
    later = later or {}
    idx = sorted(later)

    def take_now():
        versions = [_version(buffers[i], later[i]) for i in idx]
        snap = slot.pool.reserve(buffers)
        now = [i for i in range(len(buffers)) if i not in later]
        copy_into([snap[i] for i in now], [buffers[i] for i in now])
        return snap, copy.deepcopy(manifest), versions

    snap, frozen, versions = run.everywhere("taking the snapshot", take_now)
    name = f"ckpt-async-save-{_key(comm)}"
    if not later:
        handle = SaveHandle(lambda: finish(slot.dup, snap, frozen), name=name)
    else:
        assert optimizer is not None
        background = BackgroundSnapshot([snap[i] for i in idx], [buffers[i] for i in idx],
                                        [later[i] for i in idx], versions, optimizer)

        def in_background() -> Manifest:
            try:
                Collective(slot.dup, "save").everywhere("taking the background snapshot", background.take)
            finally:
                background.copied.set()  # a step waiting for the copy goes on whatever happened
            return finish(slot.dup, snap, frozen)
        try:
            handle = SaveHandle(in_background, name=name, background=background)
        except BaseException:
            background.copied.set()
            background.release()
            raise
    slot.pending = handle
    return handle
