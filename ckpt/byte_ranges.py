"""What bytes each rank writes or reads: file byte ranges matched to local buffers (pure, no MPI)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from zero import Segment, split_evenly
from .manifest import TensorEntry


@dataclass(frozen=True)
class IOItem:
    """File bytes [offset, offset + nbytes) <-> bytes [buf_offset, buf_offset + nbytes) of local
    buffer number ``buf`` (offsets counted in the file's dtype)."""

    offset: int
    nbytes: int
    buf: int
    buf_offset: int


def shard_items(segments: Iterable[Segment], entries: Mapping[int, TensorEntry], buf: int) -> list[IOItem]:
    """Items that move a rank's shard (its layout ``segments``) to or from the canonical
    tensors ``entries`` (keyed by the segments' param ids) through local buffer ``buf``."""
    out = []
    for s in segments:
        e = entries.get(s.param)
        if e is None:
            raise KeyError(f"no saved tensor for parameter {s.param}")
        if s.start + s.length > e.numel:
            raise ValueError(f"segment {s} runs past the {e.numel} elements of {e.name!r}")
        isz = e.itemsize
        out.append(IOItem(e.offset + s.start * isz, s.length * isz, buf, s.local * isz))
    return out


def whole_items(entries: Sequence[TensorEntry], bufs: Sequence[int]) -> list[IOItem]:
    """Items that move whole tensors, one local buffer each."""
    return [IOItem(e.offset, e.nbytes, b, 0) for e, b in zip(entries, bufs)]


def shift(items: Iterable[IOItem], nbytes: int) -> list[IOItem]:
    """The same items, ``nbytes`` further into the file (after a header put in front)."""
    return [IOItem(it.offset + nbytes, it.nbytes, it.buf, it.buf_offset) for it in items]


def share_items(items: Sequence[IOItem], world_size: int, rank: int, align: int = 1) -> list[IOItem]:
    """The part of replicated ``items`` that ``rank`` writes so that every byte is written once:
    the items' total bytes are split evenly (boundaries on multiples of ``align`` bytes of the
    running total) and each rank keeps its share."""
    total = sum(it.nbytes for it in items)
    lo, hi = split_evenly(total, world_size, rank, align)
    out = []
    pos = 0
    for it in items:
        a, b = max(lo, pos), min(hi, pos + it.nbytes)
        if a < b:
            skip = a - pos
            out.append(IOItem(it.offset + skip, b - a, it.buf, it.buf_offset + skip))
        pos += it.nbytes
    return out


def coalesce(items: Iterable[IOItem]) -> list[IOItem]:
    """Merge items that continue each other both in the file and in the same buffer."""
    out: list[IOItem] = []
    for it in sorted(items, key=lambda i: (i.offset, i.buf, i.buf_offset)):
        if it.nbytes == 0:
            continue
        if out:
            last = out[-1]
            if (last.buf == it.buf and last.offset + last.nbytes == it.offset
                    and last.buf_offset + last.nbytes == it.buf_offset):
                out[-1] = IOItem(last.offset, last.nbytes + it.nbytes, last.buf, last.buf_offset)
                continue
        out.append(it)
    return out


def chunk(items: Iterable[IOItem], max_bytes: int, align: int = 1,
          itemsize: Mapping[int, int] | None = None) -> list[IOItem]:
    """Split items into pieces of at most ``max_bytes``. Cuts fall on file offsets that are
    multiples of ``align`` (so that chunks line up with checksum blocks), moved back to a whole
    element of the buffer when ``itemsize`` (per buffer) says the buffer needs converting."""
    if max_bytes < align or max_bytes % align:
        raise ValueError(f"expected max_bytes a positive multiple of align={align}, got {max_bytes}")
    out = []
    for it in items:
        elem = 1 if itemsize is None else itemsize.get(it.buf, 1)
        if it.nbytes % elem or it.buf_offset % elem:
            raise ValueError(f"item {it} is not made of whole {elem}-byte elements")
        if max_bytes < 2 * elem:
            raise ValueError(f"max_bytes={max_bytes} too small for {elem}-byte elements")
        pos, end = it.offset, it.offset + it.nbytes
        while pos < end:
            stop = min(end, (pos // align) * align + max_bytes)
            if stop < end:
                stop -= (stop - it.offset) % elem
                if stop <= pos:
                    stop = pos + elem
            out.append(IOItem(pos, stop - pos, it.buf, it.buf_offset + (pos - it.offset)))
            pos = stop
    return out


def check_disjoint(items: Sequence[IOItem]) -> None:
    """Raise if two items overlap in the file."""
    srt = sorted(items, key=lambda i: i.offset)
    for a, b in zip(srt, srt[1:]):
        if a.offset + a.nbytes > b.offset:
            raise ValueError(f"items overlap: [{a.offset}, {a.offset + a.nbytes}) and "
                             f"[{b.offset}, {b.offset + b.nbytes})")


def batches(chunks: Sequence[IOItem], alone: Callable[[IOItem], bool], max_bytes: int,
            max_items: int = 4096) -> list[list[IOItem]]:
    """Group chunks (sorted by file offset) into rounds of one collective call each: a chunk
    for which ``alone`` holds gets a round to itself; others share rounds of at most
    ``max_bytes`` and ``max_items``, in increasing, non-overlapping file order (a file view)
    spanning at most ``2 * max_bytes`` of the file (MPI-IO may read and rewrite a view's whole
    span: data sieving)."""
    out: list[list[IOItem]] = []
    cur: list[IOItem] = []
    size = 0
    for c in chunks:
        if alone(c):
            if cur:
                out.append(cur)
                cur, size = [], 0
            out.append([c])
            continue
        if cur and (size + c.nbytes > max_bytes or len(cur) >= max_items
                    or c.offset < cur[-1].offset + cur[-1].nbytes
                    or c.offset + c.nbytes - cur[0].offset > 2 * max_bytes):
            out.append(cur)
            cur, size = [], 0
        cur.append(c)
        size += c.nbytes
    if cur:
        out.append(cur)
    return out
