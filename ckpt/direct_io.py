"""Move planned byte ranges between local tensors and one file with O_DIRECT, each rank on its own.

The data bypasses the page cache: no cache page is allocated, filled or written back for it. A
new file written through the cache needs as many fresh pages as it has bytes, and where memory
is slow to hand out (a virtual machine's memory given back to its host, a node whose page cache
is full of other files) that, not the disk, sets the speed. O_DIRECT moves whole aligned blocks
between the disk and an aligned staging buffer; the unaligned ends of a range (they share a
disk block with another rank's range) go through the page cache, so that no two ranks write one
disk block by different paths. Each staged chunk's CRC pieces are computed from the bytes
written or read, as the MPI-IO path does."""
from __future__ import annotations

import contextlib
import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from .byte_ranges import IOItem
from .checksum import Piece, block_ranges, crc32

ALIGN = 4096  # the smallest alignment of offsets, lengths and addresses tried with O_DIRECT
MAX_ALIGN = 1 << 20  # the largest tried: a file system that asks more is written through MPI-IO
O_DIRECT = getattr(os, "O_DIRECT", 0)


def open_direct(filename: str, write: bool) -> tuple[int, int] | None:
    """A descriptor of ``filename`` opened with O_DIRECT (created when ``write``) and the
    alignment its file system takes, or None when this system or file system refuses it (the
    caller then uses MPI-IO or plain POSIX calls, which report errors)."""
    if not O_DIRECT:
        return None
    try:
        fd = os.open(filename, (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | O_DIRECT, 0o644)
    except OSError:
        return None
    align = alignment(fd, write)
    if align is None:
        os.close(fd)
        return None
    return fd, align


def alignment(fd: int, write: bool) -> int | None:
    """The alignment O_DIRECT takes on ``fd``: tried with one block at offset 0 (a write of zeros
    to a file being created, or a read), from the file system's block size (``st_blksize``,
    at least ALIGN) up, doubling on EINVAL (a file system that accepts O_DIRECT but asks more
    than 4 KiB); None when none up to MAX_ALIGN is taken."""
    blksize = os.fstat(fd).st_blksize
    align = blksize if ALIGN <= blksize <= MAX_ALIGN and not blksize & (blksize - 1) else ALIGN
    while align <= MAX_ALIGN:
        buf = aligned_buffer(align, align)
        try:
            if write:
                buf[:] = 0
                os.pwrite(fd, memoryview(buf), 0)
            else:
                os.preadv(fd, [memoryview(buf)], 0)
            return align
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                return None
        align *= 2
    return None


def spans(offset: int, nbytes: int, align: int = ALIGN) -> list[tuple[int, int, bool]]:
    """File bytes [offset, offset + nbytes) as (start, end, whole): the unaligned head, the run of
    whole ``align``-blocks (whole=True) and the unaligned tail, the empty ones left out."""
    end = offset + nbytes
    a = min(end, -(-offset // align) * align)
    b = max(a, end // align * align)
    return [(s, e, whole) for s, e, whole in ((offset, a, False), (a, b, True), (b, end, False)) if e > s]


def aligned_buffer(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A uint8 array of ``nbytes`` whose first byte's address is a multiple of ``align``."""
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


_POOL: list[np.ndarray] = []  # staging buffers kept for the next save or load: fresh memory is slow
_POOL_LOCK = threading.Lock()
_POOL_KEEP = 2


@contextlib.contextmanager
def staging(nbytes: int, align: int = ALIGN) -> Iterator[np.ndarray]:
    """A buffer of ``nbytes`` aligned to ``align``, one of the few kept for reuse when there is one."""
    with _POOL_LOCK:
        at = next((i for i, b in enumerate(_POOL) if len(b) >= nbytes and not b.ctypes.data % align), None)
        buf = None if at is None else _POOL.pop(at)  # by position: == on arrays compares their elements
    if buf is None:
        buf = aligned_buffer(nbytes, align)
    try:
        yield buf[:nbytes]
    finally:
        with _POOL_LOCK:
            _POOL.append(buf)
            _POOL.sort(key=len, reverse=True)
            del _POOL[_POOL_KEEP:]


def _crc_pieces(offset: int, mem: np.ndarray, block_size: int) -> list[Piece]:
    return [Piece(off, ln, crc32(mem[off - offset:off - offset + ln])) for off, ln in
            block_ranges(offset, len(mem), block_size)]


def pwrite_all(fd: int, mem: np.ndarray, offset: int) -> None:
    """Write all of ``mem`` at ``offset`` (pwrite may write less than asked)."""
    view = memoryview(mem)
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"ckpt write: pwrite returned {n} at offset {offset + done}")
        done += n


def pread_all(fd: int, mem: np.ndarray, offset: int, need: int) -> None:
    """Read into ``mem`` from ``offset``; at least ``need`` bytes must come (the rest may lie past
    the end of the file)."""
    view = memoryview(mem)
    done = 0
    while done < need:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"ckpt read: expected {need} bytes at offset {offset}, the file ends after {done}")
        done += n


def write(filename: str, fd_direct: int, chunks: Sequence[IOItem], views: Sequence[torch.Tensor], *,
          file_size: int, block_size: int, staging_bytes: int, sync: bool,
          host: Callable[[torch.Tensor], np.ndarray], align: int = ALIGN) -> list[Piece]:
    """Write ``chunks`` (each at most ``staging_bytes``) from the byte ``views`` (``host`` gives a
    slice's bytes in host memory, as numpy): the file sized to ``file_size``, whole ``align``
    blocks through ``fd_direct`` (closed here), the ends through the page cache; fsync'ed with
    ``sync``. Returns the CRC of every written piece within each block (computed in a thread
    from the source bytes while they are written)."""
    fd = os.open(filename, os.O_WRONLY)
    try:
        os.ftruncate(fd, file_size)  # every rank the same size: a new file's holes read as zeros
        futures = []
        with staging(staging_bytes + 2 * align, align) as buf, ThreadPoolExecutor(max_workers=1) as pool:
            for c in chunks:
                src = host(views[c.buf][c.buf_offset:c.buf_offset + c.nbytes])
                futures.append(pool.submit(_crc_pieces, c.offset, src, block_size))
                base = c.offset // align * align  # buf[x - base] holds file byte x: aligned where x is
                buf[c.offset - base:c.offset - base + c.nbytes] = src
                for s, e, whole in spans(c.offset, c.nbytes, align):
                    pwrite_all(fd_direct if whole else fd, buf[s - base:e - base], s)
            pieces = [p for f in futures for p in f.result()]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
        os.close(fd_direct)
    return pieces


def read(fd_direct: int, chunks: Sequence[IOItem], dests: Sequence[torch.Tensor],
         views: Sequence[torch.Tensor | None], file_dtypes: Sequence[torch.dtype], itemsize: dict[int, int], *,
         block_size: int, staging_bytes: int, unchecked: set[int], align: int = ALIGN) -> list[Piece]:
    """Read ``chunks`` (each at most ``staging_bytes``, of whole elements) into ``dests`` through
    ``fd_direct`` (closed here): each chunk's span, widened to ``align`` blocks, in one read, its
    bytes then copied (or converted from ``file_dtypes``) into place. Returns the CRC of every
    piece read within each block, except for the dests numbered in ``unchecked``."""
    pieces: list[Piece] = []
    try:
        with staging(staging_bytes + 2 * align, align) as buf:
            for c in chunks:
                base = c.offset // align * align
                top = -(-(c.offset + c.nbytes) // align) * align
                pread_all(fd_direct, buf[:top - base], base, c.offset + c.nbytes - base)
                mem = buf[c.offset - base:c.offset - base + c.nbytes]
                if c.buf not in unchecked:
                    pieces += _crc_pieces(c.offset, mem, block_size)
                part = torch.from_numpy(mem)
                if views[c.buf] is not None:
                    views[c.buf][c.buf_offset:c.buf_offset + c.nbytes].copy_(part)
                else:
                    e0, n = c.buf_offset // itemsize[c.buf], c.nbytes // itemsize[c.buf]
                    if mem.ctypes.data % itemsize[c.buf]:
                        part = part.clone()  # torch views a dtype only at aligned addresses
                    dests[c.buf].view(-1)[e0:e0 + n].copy_(part.view(file_dtypes[c.buf]))
    finally:
        os.close(fd_direct)
    return pieces
