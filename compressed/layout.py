"""Sizes and message layout of the 1-bit compressed allreduce (pure arithmetic, no MPI)."""
from __future__ import annotations

from dataclasses import dataclass

#: Bytes in front of every packed chunk: the sender's float32 scale, little-endian.
HEADER_BYTES = 4


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
    """How ``numel`` elements are padded, split in ``world_size`` chunks and packed on the wire.

    Both phases send per peer ``row_bytes`` bytes: a float32 scale (``HEADER_BYTES``) and
    ``chunk_bytes`` bytes of signs, 8 per byte, most significant bit first, bit 1 meaning >= 0.
    Phase 1 sends chunk ``j`` of the worker's signs to rank ``j`` and the worker scale to every
    rank (the host path in two messages, the scale after the signs; the torch path as one row
    headed by the scale); phase 2 gathers every rank's row of server signs headed by its scale.
    """

    numel: int
    world_size: int

    def __post_init__(self) -> None:
        padded_size(self.numel, self.world_size)  # validates

    @property
    def padded(self) -> int:
        """Padded element count (worker error size)."""
        return padded_size(self.numel, self.world_size)

    @property
    def chunk(self) -> int:
        """Elements per rank's chunk (server error size)."""
        return self.padded // self.world_size

    @property
    def chunk_bytes(self) -> int:
        """Bytes of packed signs per chunk."""
        return self.chunk // 8

    @property
    def row_bytes(self) -> int:
        """Bytes of one message row: header plus packed signs."""
        return HEADER_BYTES + self.chunk_bytes

    def wire_bytes(self) -> int:
        """Bytes one rank sends in both phases (all-to-all, then a ring allgather)."""
        return 2 * (self.world_size - 1) * self.row_bytes


def fp32_allreduce_wire_bytes(numel: int, world_size: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal (ring) fp32 allreduce of ``numel`` elements."""
    p = int(world_size)
    return 2 * (p - 1) * 4 * int(numel) // p if p > 1 else 0
