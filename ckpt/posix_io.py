"""Move planned byte ranges between local tensors and one file with plain POSIX calls (pwrite,
pread through the page cache), each rank on its own: no MPI call at all.

The path a rank takes under ULFM where its file system refuses O_DIRECT (Open MPI documents
MPI-IO as not fault tolerant), or wherever ``MPICOMM_CKPT_IO=posix`` asks for it. The file is
the one the MPI-IO and O_DIRECT paths make: every byte at its planned offset, the file sized by
every rank (``ftruncate`` to the same size, so the order of the ranks does not matter). Each
chunk's CRC pieces are computed from the bytes written or read, as on the other paths."""
from __future__ import annotations

import ctypes
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np
import torch

from .byte_ranges import IOItem
from .checksum import Piece, block_ranges, crc32
from .direct_io import pread_all, pwrite_all, staging


def crc_pieces(offset: int, mem: np.ndarray, block_size: int) -> list[Piece]:
    """The CRC of ``mem`` (file bytes from ``offset``) cut at every ``block_size`` boundary."""
    return [Piece(off, ln, crc32(mem[off - offset:off - offset + ln]))
            for off, ln in block_ranges(offset, len(mem), block_size)]


def _load_sync_file_range():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        return fn
    except (OSError, AttributeError):
        return None


SYNC_FILE_RANGE = _load_sync_file_range() if sys.platform.startswith("linux") else None


def start_writeback(fd: int | None, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing a byte range back now (Linux sync_file_range), so that
    the final sync waits only for the tail; a no-op elsewhere."""
    if fd is None or SYNC_FILE_RANGE is None:
        return
    SYNC_FILE_RANGE(fd, ctypes.c_int64(offset), ctypes.c_int64(nbytes), 2)  # SYNC_FILE_RANGE_WRITE


def write(filename: str, chunks: Sequence[IOItem], views: Sequence[torch.Tensor], *, file_size: int,
          block_size: int, sync: bool, host: Callable[[torch.Tensor], np.ndarray]) -> list[Piece]:
    """Create ``filename`` (or open it: another rank may have), size it to ``file_size`` and write
    ``chunks`` from the byte ``views`` (``host`` gives a slice's bytes in host memory, as numpy),
    each straight from that memory; fsync'ed with ``sync``. Returns the CRC of every written
    piece within each block (computed in a thread from the source bytes while they are written)."""
    fd = os.open(filename, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, file_size)  # every rank the same size: a new file's holes read as zeros
        futures = []
        with ThreadPoolExecutor(max_workers=1) as pool:
            for c in chunks:
                src = host(views[c.buf][c.buf_offset:c.buf_offset + c.nbytes])
                futures.append(pool.submit(crc_pieces, c.offset, src, block_size))
                pwrite_all(fd, src, c.offset)
                if sync:
                    start_writeback(fd, c.offset, c.nbytes)
            pieces = [p for f in futures for p in f.result()]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return pieces


def read(filename: str, chunks: Sequence[IOItem], dests: Sequence[torch.Tensor],
         views: Sequence[torch.Tensor | None], file_dtypes: Sequence[torch.dtype], itemsize: dict[int, int], *,
         block_size: int, staging_bytes: int, unchecked: set[int]) -> list[Piece]:
    """Read ``chunks`` into ``dests``: straight into the byte ``views`` where there is one (a
    host tensor of the file's dtype), else through a staging buffer of ``staging_bytes``
    (chunks no larger), converted from ``file_dtypes``. Returns the CRC of every piece read
    within each block, except for the dests numbered in ``unchecked``."""
    futures: list = []
    pieces: list[Piece] = []
    fd = os.open(filename, os.O_RDONLY)
    try:
        with staging(max(staging_bytes, 1)) as buf, ThreadPoolExecutor(max_workers=1) as pool:
            for c in chunks:
                view = views[c.buf]
                if view is not None:  # in place; its checksum in the thread while the next chunk is read
                    mem = view[c.buf_offset:c.buf_offset + c.nbytes].numpy()
                    pread_all(fd, mem, c.offset, c.nbytes)
                    if c.buf not in unchecked:
                        futures.append(pool.submit(crc_pieces, c.offset, mem, block_size))
                    continue
                mem = buf[:c.nbytes]
                pread_all(fd, mem, c.offset, c.nbytes)
                if c.buf not in unchecked:
                    pieces += crc_pieces(c.offset, mem, block_size)
                part = torch.from_numpy(mem)
                e0, n = c.buf_offset // itemsize[c.buf], c.nbytes // itemsize[c.buf]
                dests[c.buf].view(-1)[e0:e0 + n].copy_(part.view(file_dtypes[c.buf]))
            pieces += [p for f in futures for p in f.result()]
    finally:
        os.close(fd)
    return pieces
