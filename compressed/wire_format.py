"""Sizes and wire format of the 1-bit compressed allreduce (pure arithmetic, no MPI).

The wire format is the same whatever kernels a rank runs (numba, numpy or torch, host or
device), so ranks that pick different kernels interoperate. With ``n`` elements on ``p`` ranks:

- the input is zero-padded to ``padded = padded_size(n, p)`` elements and cut in ``p`` chunks
  of ``chunk = padded / p`` elements; chunk ``j`` belongs to rank ``j``;
- signs are packed 8 per byte, most significant bit first, bit 1 meaning ``x >= 0``: a chunk
  is ``chunk_bytes = chunk / 8`` bytes, cut in at most ``MAX_PIECES`` pieces of at least
  ``PIECE_BYTES`` bytes (``pieces()``: the same byte ranges in every chunk);
- phase 1, one ``all_to_all_single`` per piece ``k``: row ``j`` of the uint8 message is piece
  ``k`` of chunk ``j``'s worker signs; the last piece's rows end with ``P1_TRAILER`` bytes: the
  sender's float32 worker scale and ``n mod 2**32`` as uint32 (both little-endian), so every rank
  learns every rank's scale and size;
- phase 2, one ``all_gather_into_tensor`` per piece: piece ``k`` of the sender's server signs;
  the last piece ends with ``P2_TRAILER`` bytes, the sender's float32 server scale.

Several pieces let compression of the next piece overlap the transfer of the previous one.
Between ranks of one node there is no transfer worth overlapping and every piece is one more
synchronisation, so the communicator's ranks all on one node send one piece per phase (all
ranks see the same node count, so they agree on the layout).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

#: Smallest piece worth a message of its own, in bytes of packed signs per chunk.
PIECE_BYTES = 1 << 17
#: Most pieces per phase by default (ranks on several nodes): packing piece k + 1 overlaps the
#: transfer of piece k. Measured on netsim (64 MiB, 2 hosts, 1 Gbit/s, 2-core machine under a
#: load of ~20, two alternating pairs of runs): MpiBackend 281/305 ms with 1 piece, 217/238 ms
#: with 4; OnebitAllreduce 199/239 ms against 143/196 ms. (An earlier run had measured the
#: opposite; ``MPICOMM_ONEBIT_PIECES`` overrides it per run.)
MAX_PIECES = 4
#: Bytes after the last phase-1 piece of each row: float32 worker scale, uint32 numel mod 2**32.
P1_TRAILER = 8
#: Bytes after the last phase-2 piece: float32 server scale.
P2_TRAILER = 4


def padded_size(numel: int, world_size: int) -> int:
    """Return ``numel`` rounded up to a multiple of ``8 * world_size`` (the worker error's size)."""
    numel = int(numel)
    world_size = int(world_size)
    if numel < 0:
        raise ValueError(f"padded_size: numel must be >= 0, got {numel}")
    if world_size < 1:
        raise ValueError(f"padded_size: world_size must be >= 1, got {world_size}")
    unit = 8 * world_size
    return -(-numel // unit) * unit


@dataclass(frozen=True)
class Layout:
    """How ``numel`` elements are padded, split in ``world_size`` chunks and sent (module doc)."""

    numel: int
    world_size: int
    #: Most pieces per phase (None: ``MAX_PIECES``); 1 when overlap buys nothing (one node).
    max_pieces: int | None = None

    def __post_init__(self) -> None:
        padded_size(self.numel, self.world_size)  # validates

    # derived once per layout (a frozen dataclass: cached_property writes its own __dict__)
    @cached_property
    def padded(self) -> int:
        """Padded element count (worker error size)."""
        return padded_size(self.numel, self.world_size)

    @cached_property
    def chunk(self) -> int:
        """Elements per rank's chunk (server error size)."""
        return self.padded // self.world_size

    @cached_property
    def chunk_bytes(self) -> int:
        """Bytes of packed signs per chunk."""
        return self.chunk // 8

    def pieces(self) -> list[tuple[int, int]]:
        """Byte ranges [lo, hi) of a chunk's packed signs sent as one message each (>= 1)."""
        return list(self._pieces)

    @cached_property
    def _pieces(self) -> tuple[tuple[int, int], ...]:
        cb = self.chunk_bytes
        most = MAX_PIECES if self.max_pieces is None else max(1, int(self.max_pieces))
        step = max(8, PIECE_BYTES - PIECE_BYTES % 8, -(-cb // (8 * most)) * 8)
        return tuple((lo, min(lo + step, cb)) for lo in range(0, cb, step)) or ((0, 0),)

    def wire_bytes(self) -> int:
        """Bytes one rank sends to the other ranks in both phases."""
        p = self.world_size
        return (p - 1) * (self.chunk_bytes + P1_TRAILER) + (p - 1) * (self.chunk_bytes + P2_TRAILER)


def fp32_allreduce_wire_bytes(numel: int, world_size: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal (ring) fp32 allreduce of ``numel`` elements."""
    p = int(world_size)
    return 2 * (p - 1) * 4 * int(numel) // p if p > 1 else 0
