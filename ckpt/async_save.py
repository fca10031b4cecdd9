"""Asynchronous saves: snapshot into reused host memory, then write, checksum and commit in a
background thread on a duplicated communicator; at most one save in flight per communicator."""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable

import torch
from mpi4py import MPI

from .errors import CheckpointError
from .io import byte_view
from .manifest import Manifest

ALIGN = 64


class AsyncSaveError(CheckpointError, RuntimeError):
    """An asynchronous save cannot start (e.g. MPI lacks MPI_THREAD_MULTIPLE)."""


class SnapshotPool:
    """Host memory that a save's buffers are copied into, kept and reused across saves (its
    pages are touched once, when it grows), so a snapshot costs one memory copy."""

    def __init__(self) -> None:
        self.arena = torch.empty(0, dtype=torch.uint8)

    def snapshot(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``buffers`` (contiguous; any device) as flat uint8 host tensors in the pool."""
        sizes = [b.numel() * b.element_size() for b in buffers]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // ALIGN) * ALIGN
        if total > self.arena.numel():
            self.arena = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self.arena = torch.zeros(total + total // 8, dtype=torch.uint8)  # zeros: touch every page now
        out = []
        for b, off, n in zip(buffers, offsets, sizes):
            dst = self.arena[off:off + n]
            dst.copy_(byte_view(b))
            out.append(dst)
        if any(b.device.type == "cuda" for b in buffers):
            torch.cuda.synchronize()
        return out


class SaveHandle:
    """A save in flight: ``wait()`` returns its Manifest (or raises its failure, the same on
    every rank), ``done()`` tells without waiting."""

    def __init__(self, fn: Callable[[], Manifest], name: str) -> None:
        self._result: Manifest | None = None
        self._error: BaseException | None = None
        self._reported = False
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Manifest]) -> None:
        try:
            self._result = fn()
        except BaseException as exc:  # noqa: BLE001 - kept for wait(), raised on the caller's thread
            self._error = exc

    def done(self) -> bool:
        """True when the save has committed or failed."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Manifest:
        """Block until the save has committed and return its manifest; a failure (the same on
        every rank) is raised here, once."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the asynchronous save is still writing after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error
        assert self._result is not None
        return self._result

    def _settle(self) -> None:
        """Wait; raise the failure unless it was raised already."""
        self._thread.join()
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error


class _Slot:
    """Per communicator: its duplicate for background I/O, the snapshot pool, the save in flight."""

    def __init__(self, comm: Any) -> None:
        self.source = comm.mpi_comm  # held, so that its id (the slot's key) is never reused
        self.dup = comm.dup()
        self.pool = SnapshotPool()
        self.pending: SaveHandle | None = None


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
            handle._settle()


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
          finish: Callable[[Any, list[torch.Tensor], Manifest], Manifest]) -> SaveHandle:
    """Snapshot ``buffers`` and the manifest on every rank (raising on every rank if any rank
    fails), then run ``finish(dup_comm, snapshot, manifest)`` in the background."""
    slot = slot_for(comm)
    snap, frozen = run.everywhere("taking the snapshot", lambda: (slot.pool.snapshot(buffers),
                                                                  copy.deepcopy(manifest)))
    handle = SaveHandle(lambda: finish(slot.dup, snap, frozen), name=f"ckpt-async-save-{_key(comm)}")
    slot.pending = handle
    return handle
