"""CRC-32 per fixed-size file block, assembled from pieces written or read by any rank (pure)."""
from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Iterable

import numpy as np

ALGORITHM = "crc32"
_POLY = 0xEDB88320  # reflected CRC-32 polynomial (the one zlib uses)


def _mult_mod_p(a: int, b: int) -> int:
    """Multiply two polynomials modulo the CRC polynomial (reflected bit order)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    table = []
    p = 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _mult_mod_p(p, p)
    return table


_X2N = _x2n_table()


@functools.lru_cache(maxsize=4096)
def _x8n_mod_p(nbytes: int) -> int:
    """Return x^(8 * nbytes) modulo the CRC polynomial."""
    p = 1 << 31  # x^0
    k = 3
    n = nbytes
    while n:
        if n & 1:
            p = _mult_mod_p(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def _fast_crc32():
    """ISA-L's CRC-32 (the same values as zlib's, several times faster) when installed."""
    try:
        from isal.isal_zlib import crc32 as fast  # type: ignore[import-not-found]
    except ImportError:
        return None
    return fast if fast(b"123456789") == zlib.crc32(b"123456789") else None


_CRC32 = _fast_crc32() or zlib.crc32
FAST = _CRC32 is not zlib.crc32


def crc32(data) -> int:
    """CRC-32 (zlib's) of a bytes-like object; uses ISA-L (package ``isal``) when present."""
    return _CRC32(data) & 0xFFFFFFFF


@dataclass(frozen=True)
class Piece:
    """CRC of file bytes [offset, offset + length), lying inside one block."""

    offset: int
    length: int
    crc: int


def block_ranges(offset: int, length: int, block_size: int) -> list[tuple[int, int]]:
    """Split [offset, offset+length) at multiples of ``block_size``; returns (offset, length)."""
    out = []
    pos, end = offset, offset + length
    while pos < end:
        stop = min(end, (pos // block_size + 1) * block_size)
        out.append((pos, stop - pos))
        pos = stop
    return out


def num_blocks(file_size: int, block_size: int) -> int:
    return -(-file_size // block_size)


def zeros_crc(n: int) -> int:
    """CRC-32 of ``n`` zero bytes (without touching n bytes)."""
    return _mult_mod_p(_x8n_mod_p(n), 0xFFFFFFFF) ^ 0xFFFFFFFF


def _mult_many(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``_mult_mod_p`` element-wise over uint64 arrays."""
    p = np.zeros(np.broadcast(a, b).shape, np.uint64)
    b = b.copy() if isinstance(b, np.ndarray) else np.full(p.shape, b, np.uint64)
    poly = np.uint64(_POLY)
    for i in range(31, -1, -1):
        p ^= np.where(a & np.uint64(1 << i), b, np.uint64(0))
        b = np.where(b & np.uint64(1), (b >> np.uint64(1)) ^ poly, b >> np.uint64(1))
    return p


def _x8n_many(n: np.ndarray) -> np.ndarray:
    """``_x8n_mod_p`` element-wise over a uint64 array."""
    p = np.full(n.shape, 1 << 31, np.uint64)
    k = 3
    n = n.copy()
    while n.any():
        sel = (n & np.uint64(1)).astype(bool)
        if sel.any():
            p[sel] = _mult_many(np.uint64(_X2N[k & 31]), p[sel])
        n >>= np.uint64(1)
        k += 1
    return p


def block_parts(pieces: Iterable[Piece], file_size: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's share of every block's CRC, of a fixed size (one per block whatever the rank
    count): per block, the XOR of its pieces' linear CRC parts (a piece's CRC as if the rest of
    the block were zeros, less the CRC of zeros) and its byte count. XOR-ing every rank's parts
    and summing their counts (``blocks_from_parts``) gives the block CRCs of pieces that tile
    the file, written by any ranks."""
    n = num_blocks(file_size, block_size)
    parts = np.zeros(n, np.uint32)
    counts = np.zeros(n, np.int64)
    arr = np.array([(p.offset, p.length, p.crc) for p in pieces], np.int64).reshape(-1, 3)
    if not len(arr):
        return parts, counts
    off, ln, crc = arr[:, 0], arr[:, 1], arr[:, 2].astype(np.uint64)
    blk = off // block_size
    stop = np.minimum(file_size, (blk + 1) * block_size)
    bad = np.flatnonzero((ln <= 0) | (off < 0) | (off + ln > stop))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"piece [{off[i]}, {off[i] + ln[i]}) is not inside one {block_size}-byte block of a "
                         f"{file_size}-byte file")
    ones = np.uint64(0xFFFFFFFF)
    lin = crc ^ _mult_many(_x8n_many(ln.astype(np.uint64)), ones) ^ ones  # the piece's CRC less the CRC of zeros
    tail = (stop - off - ln).astype(np.uint64)
    shifted = np.flatnonzero(tail)
    if len(shifted):
        lin[shifted] = _mult_many(_x8n_many(tail[shifted]), lin[shifted])
    np.bitwise_xor.at(parts, blk, lin.astype(np.uint32))
    np.add.at(counts, blk, ln)
    return parts, counts


def blocks_from_parts(parts: np.ndarray, counts: np.ndarray, file_size: int, block_size: int) -> list[int]:
    """Per-block CRCs from every rank's ``block_parts``, XOR-ed and summed; raises unless each
    block's pieces hold exactly its bytes."""
    n = num_blocks(file_size, block_size)
    sizes = np.full(n, block_size, np.int64)
    if n:
        sizes[-1] = file_size - (n - 1) * block_size
    if len(parts) != n or len(counts) != n or not np.array_equal(counts, sizes):
        bad = [b for b in range(min(n, len(counts))) if counts[b] != sizes[b]][:1] or [min(n, len(counts))]
        b = bad[0]
        raise ValueError(f"the written pieces do not cover block {b} (bytes [{b * block_size}, "
                         f"{min(file_size, (b + 1) * block_size)})) exactly")
    full = zeros_crc(block_size)
    out = (parts ^ np.uint32(full)).tolist()
    if n and sizes[-1] != block_size:
        out[-1] = int(parts[-1]) ^ zeros_crc(int(sizes[-1]))
    return out
