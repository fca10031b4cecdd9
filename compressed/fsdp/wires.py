"""Reused host buffers of packed int8 rows for the quantized FSDP2 collectives.

A ``Wire`` holds one call's send and receive rows (``quantize``'s wire format) and numpy views
of their scales and values, so that a call on the CPU makes no tensor and no view. Wires are
kept in a pool keyed by row length, block count and row counts (modules of the same shapes
share them); a wire is taken for one call and put back when the call (or its work) is done, so
two calls in flight never share one. Only wires up to ``KEEP_BYTES`` are kept (at most
``KEEP_PER_SHAPE`` per shape): large calls allocate their own, so the pool never holds a
gathered model's worth of memory.
"""
from __future__ import annotations

import numpy as np
import torch

from .quantize import Layout

__all__ = ["Wire", "acquire", "release", "KEEP_BYTES", "KEEP_PER_SHAPE"]

#: largest wire (send + receive bytes) that the pool keeps for reuse
KEEP_BYTES = 4 << 20
#: free wires kept per shape (calls of one shape in flight at once beyond this allocate)
KEEP_PER_SHAPE = 2

_FREE: dict[tuple[int, int, int, int], list[Wire]] = {}


class Wire:
    """Send rows (``send_rows`` x ``lay.nbytes``, padding zeroed) and receive rows on the host,
    with fp32 scale and int8 value views of each."""

    __slots__ = ("key", "send", "recv", "send_scale", "send_q", "recv_scale", "recv_q")

    def __init__(self, lay: Layout, send_rows: int, recv_rows: int) -> None:
        self.key = (lay.n, lay.nblocks, send_rows, recv_rows)
        # not zero-filled (a large call makes a new wire each time): the kernels write every
        # scale and value they send and the transfer every received byte; only the send rows'
        # padding to 4 bytes is zeroed here, once
        self.send = torch.empty(send_rows, lay.nbytes, dtype=torch.uint8)
        self.send[:, 4 * lay.nblocks + lay.n:].zero_()
        self.recv = torch.empty(recv_rows, lay.nbytes, dtype=torch.uint8)
        self.send_scale, self.send_q = _views(self.send.numpy(), lay)
        self.recv_scale, self.recv_q = _views(self.recv.numpy(), lay)


def _views(rows: np.ndarray, lay: Layout) -> tuple[np.ndarray, np.ndarray]:
    start = 4 * lay.nblocks
    return rows[:, :start].view(np.float32), rows[:, start:start + lay.n].view(np.int8)


def acquire(lay: Layout, send_rows: int, recv_rows: int) -> Wire:
    """A free wire of this shape from the pool, or a new one."""
    free = _FREE.get((lay.n, lay.nblocks, send_rows, recv_rows))
    if free:
        try:
            return free.pop()
        except IndexError:  # another thread took the last one
            pass
    return Wire(lay, send_rows, recv_rows)


def release(wire: Wire) -> None:
    """Give ``wire`` back to the pool (kept if small enough and its shape has room)."""
    if (wire.send.numel() + wire.recv.numel()) > KEEP_BYTES:
        return
    free = _FREE.setdefault(wire.key, [])
    if len(free) < KEEP_PER_SHAPE:
        free.append(wire)
