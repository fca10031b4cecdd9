"""A ZeroOptimizer shard's committed copies in POSIX shared memory, mapped by its buddy when the
buddy runs on the same host: the replica is the rank's own copy, and committing sends nothing.

A process that dies leaves its mappings to whoever else maps them, so the buddy still reads
the shard of a rank killed on its host; a host lost whole takes both, as it takes a replica
held in the buddy's own memory. Buddies on other hosts (``TorchState``'s failure domains put
them there when there are several hosts) are sent the shard through MPI as before.

Each rank's segment holds two areas, each a header (the generation it holds whole, -1 while
one is written, and the generation being or last written) and the pieces: when some buddy is sent its shard through MPI, two slots (the two
commits a ``TorchState`` keeps then: a commit can be cut short on a survivor); when every
replica goes through shared memory, the rank's live shard (its optimizer state is moved there)
and one slot: no commit sends anything, so every survivor completes the commit it is in, and a
rank that dies writing its slot leaves its live shard, still what that commit was copying, to
its buddy (the header says which commit that was; ``TorchState`` agrees over the communicator
before a commit overwrites the single slot, so every survivor writes it or none does). One
extra shard per rank. The file is unlinked as soon
as the buddy has mapped it: nothing is left in ``/dev/shm`` however the job ends, and the
memory goes back when the last of the two processes does.
"""
from __future__ import annotations

import json
import mmap
import os
import secrets
from typing import Any, Sequence

import torch

import mpicomm

__all__ = ["ENV", "Segment", "Shared", "enabled", "setup"]

#: ``MPICOMM_ELASTIC_SHM=0`` sends every replica through MPI, on one host too.
ENV = "MPICOMM_ELASTIC_SHM"
DIR = "/dev/shm"
_ALIGN = 64
_TAG = 29329   # apart from the other elastic tags (state 29029+, fsdp 29129+, repartition 29229+)


def enabled() -> bool:
    """Whether replicas may go through shared memory (``MPICOMM_ELASTIC_SHM`` not "0", and a
    ``/dev/shm`` here)."""
    return os.environ.get(ENV, "1") != "0" and os.path.isdir(DIR)


def _specs(pieces: Sequence[torch.Tensor]) -> list[tuple[str, int]]:
    return [(str(t.dtype).removeprefix("torch."), int(t.numel())) for t in pieces]


def _layout(specs: Sequence[tuple[str, int]]) -> tuple[list[int], int]:
    """Offsets of the pieces after an aligned header, and the bytes of one slot."""
    offsets, at = [], _ALIGN
    for name, numel in specs:
        offsets.append(at)
        at += -(-numel * getattr(torch, name).itemsize // _ALIGN) * _ALIGN
    return offsets, at


class Segment:
    """One rank's two areas of commit pieces in one shared mapping: two slots taken in turn by
    the commits' parity, or (``live``) the rank's live shard and one slot."""

    def __init__(self, mm: mmap.mmap, specs: Sequence[tuple[str, int]]) -> None:
        self._mm = mm                                   # kept: the views below borrow it
        base = torch.frombuffer(mm, dtype=torch.uint8)
        offsets, size = _layout(specs)
        self.specs = [tuple(s) for s in specs]
        self.live = False
        self._headers, self._areas = [], []
        for area in range(2):
            at = area * size
            self._headers.append(base[at:at + 16].view(torch.int64))    # [whole, being written]
            self._areas.append([base[at + o:at + o + n * getattr(torch, d).itemsize].view(getattr(torch, d))
                                for o, (d, n) in zip(offsets, specs)])

    @staticmethod
    def nbytes(specs: Sequence[tuple[str, int]]) -> int:
        return 2 * _layout(specs)[1]

    def _slot(self, gen: int) -> int:
        return 1 if self.live else gen % 2

    def pieces(self, gen: int) -> list[torch.Tensor]:
        """The slot of commit ``gen``."""
        return self._areas[self._slot(gen)]

    def live_pieces(self) -> list[torch.Tensor]:
        """The live shard's area (``live`` only)."""
        assert self.live
        return self._areas[0]

    def begin(self, gen: int) -> None:
        """Mark commit ``gen``'s slot as being written with ``gen`` (no longer whole)."""
        head = self._headers[self._slot(gen)]
        head[0] = -1
        head[1] = gen

    def finish(self, gen: int) -> None:
        """Mark commit ``gen``'s slot as holding it whole."""
        self._headers[self._slot(gen)][0] = gen

    def holds(self, gen: int) -> bool:
        """Whether commit ``gen``'s slot holds it whole (its owner finished writing it and has
        not begun a later commit there)."""
        return int(self._headers[self._slot(gen)][0]) == gen

    def writing(self, gen: int) -> bool:
        """Whether commit ``gen``'s slot was being written with ``gen`` and is not whole (its
        owner died, or is, writing it)."""
        head = self._headers[self._slot(gen)]
        return int(head[0]) == -1 and int(head[1]) == gen


class Shared:
    """What goes through shared memory between this rank and its buddy and ward. ``live``: every
    rank of the communicator has both in shared memory, and each keeps its live shard there too
    (one slot then: a rank that dies writing its commit leaves its live shard, which that commit
    was copying, to its buddy)."""

    def __init__(self, own: Segment | None, ward: Segment | None, specs: list[tuple[str, int]],
                 live: bool = False) -> None:
        self.own = own      # this rank's slots, mapped by its buddy (None: the shard is sent)
        self.ward = ward    # the ward's slots, mapped here (None: its shard is received)
        self.specs = specs
        self.live = live
        for seg in (own, ward):
            if seg is not None:
                seg.live = live

    def fits(self, pieces: Sequence[torch.Tensor]) -> bool:
        return _specs(pieces) == self.specs


def _create(specs: list[tuple[str, int]]) -> tuple[str, mmap.mmap] | None:
    size = Segment.nbytes(specs)
    try:
        st = os.statvfs(DIR)
        if st.f_bavail * st.f_frsize < 2 * size:       # room for it, and as much to spare
            return None
        name = f"mpicomm-elastic-{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(os.path.join(DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.ftruncate(fd, size)
        return name, mmap.mmap(fd, size)
    except OSError:
        os.unlink(os.path.join(DIR, name))
        return None
    finally:
        os.close(fd)


def _open(name: str, specs: list[tuple[str, int]]) -> mmap.mmap | None:
    try:
        fd = os.open(os.path.join(DIR, name), os.O_RDWR)
    except OSError:
        return None
    try:
        return mmap.mmap(fd, Segment.nbytes(specs))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _send_text(comm: Any, text: str, dst: int, tag: int) -> list[Any]:
    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    return [comm.isend(torch.tensor([data.numel()], dtype=torch.int64), dst, tag=tag),
            comm.isend(data, dst, tag=tag + 1)]


def _recv_text(comm: Any, src: int, tag: int) -> str:
    n = torch.zeros(1, dtype=torch.int64)
    comm.irecv(n, src, tag=tag).wait()
    data = torch.empty(int(n), dtype=torch.uint8)
    comm.irecv(data, src, tag=tag + 1).wait()
    return bytes(data.numpy()).decode()


def setup(comm: Any, buddy: int, ward: int, buddy_here: bool, ward_here: bool,
          pieces: Sequence[torch.Tensor], live: bool = False) -> Shared:
    """Agree with the buddy and the ward (point to point over ``comm``) on what goes through
    shared memory: this rank's slots when ``buddy_here`` (the buddy runs on this host) and the
    buddy could map them, the ward's likewise; ``Shared.live`` when all of it does on every
    rank and every rank passes ``live`` (its live shard can be kept there: the optimizer
    updates the tensors ``pieces`` in place). Every rank of ``comm`` calls it at the same
    commit."""
    specs = _specs(pieces)
    made = _create(specs) if buddy_here and enabled() else None
    ack = torch.zeros(1, dtype=torch.int64)
    try:
        offer = json.dumps({"name": made[0], "specs": specs} if made else {})
        works = _send_text(comm, offer, buddy, _TAG)
        theirs = json.loads(_recv_text(comm, ward, _TAG))
        mapped = None
        if ward_here and theirs.get("name") and [tuple(s) for s in theirs["specs"]] == specs:
            mapped = _open(theirs["name"], specs)
        works.append(comm.isend(torch.tensor([int(mapped is not None)], dtype=torch.int64), ward, tag=_TAG + 2))
        comm.irecv(ack, buddy, tag=_TAG + 2).wait()
        for w in works:
            w.wait()
    finally:    # mapped by both, by none, or a failure on the way: the file goes either way
        if made is not None:
            os.unlink(os.path.join(DIR, made[0]))
    own = Segment(made[1], specs) if made is not None and int(ack) else None
    everywhere = torch.tensor([int(live and own is not None and mapped is not None)], dtype=torch.int64)
    comm.all_reduce(everywhere, op=mpicomm.ReduceOp.MIN)
    return Shared(own, Segment(mapped, specs) if mapped is not None else None, specs, live=bool(everywhere))
