"""FSDP2 custom collectives that move int8 per block: the weight all-gather and the gradient
reduce-scatter (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``).

Both run on any torch.distributed process group (mpicomm, gloo, NCCL): the payload is one
uint8 tensor on the caller's device moved by ``all_gather_into_tensor`` / ``all_to_all_single``.
With ``async_op=True`` they return a work whose ``wait()`` waits for the transfer and then
dequantizes into FSDP2's output.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from .quantize import Layout, dequantize_into, layout, quantize_rows, reduce_rows

__all__ = ["QuantizedAllGather", "QuantizedReduceScatter", "check_bits", "DEFAULT_BLOCK"]

#: elements per quantization block (one fp32 scale each: 0.8% over the int8 bytes)
DEFAULT_BLOCK = 512
_RED = dist.ReduceOp.RedOpType


def check_bits(bits: object, allowed: tuple, what: str) -> int | None:
    """Return ``bits`` if it is one of ``allowed``, else raise ValueError naming ``what``."""
    if bits is None and None in allowed:
        return None
    if isinstance(bits, int) and not isinstance(bits, bool) and bits in allowed:
        return bits
    raise ValueError(f"{what}: expected bits in {allowed} (None: FSDP2's own collective), "
                     f"got {bits!r}")


def _check_block(block: object, what: str) -> int:
    if isinstance(block, int) and not isinstance(block, bool) and block >= 1:
        return block
    raise ValueError(f"{what}: expected block as a positive number of elements, got {block!r}")


class _ThenWork(dist.Work):
    """A work that waits for ``inner`` and then runs ``then`` once (the dequantization)."""

    def __init__(self, inner: dist.Work, then: Callable[[], None]) -> None:
        super().__init__()
        self._inner, self._then = inner, then

    def _finish(self) -> None:
        if self._then is not None:
            then, self._then = self._then, None
            then()

    def wait(self, timeout=None) -> bool:  # noqa: D401 - torch's signature
        if timeout is None:
            self._inner.wait()
        else:
            self._inner.wait(timeout)
        self._finish()
        return True

    def is_completed(self) -> bool:
        return self._then is None

    def is_success(self) -> bool:
        return self._then is None


class _Done(dist.Work):
    """A work already finished (nothing to move: a group of one)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def _communicator(group: dist.ProcessGroup, async_op: bool):
    """The mpicomm Communicator under ``group`` for a blocking call, else None.

    A blocking call on an mpicomm process group goes to its Communicator directly (one MPI
    call, ~100 us less per call at 16-64 KiB than the process group's work); it waits in MPI
    without the group's timeout. Async calls and other groups keep the process group's path.
    """
    if async_op:
        return None
    try:
        from mpicomm.distributed._pg import MpicommProcessGroup
    except ImportError:
        return None
    if not isinstance(group, MpicommProcessGroup) or group.comm is None or group._broken:
        return None  # a destroyed or broken group: its own path raises the clear error
    return group.comm


def _finish(start: Callable[[bool], dist.Work | None], then: Callable[[], None], async_op: bool):
    """Start the transfer (blocking unless ``async_op``); run ``then`` now or in the work's
    ``wait()``."""
    if async_op:
        return _ThenWork(start(True), then)
    start(False)
    then()
    return None


def _row_layout(n: int, block: int, segments: Sequence[int] | None) -> Layout:
    """The layout of a row; segments that do not describe the row fall back to plain blocks."""
    if segments and sum(segments) == n:
        return layout(n, block, segments)
    return layout(n, block)


class _Quantized:
    def __init__(self, bits, block, segments, what: str, allowed: tuple) -> None:
        self.bits = check_bits(bits, allowed, what)
        if self.bits is None:
            raise ValueError(f"{what}: bits=None means FSDP2's own collective; use "
                             "quantize_comms(..., None) to leave a side unquantized")
        self.block = _check_block(block, what)
        self.segments = tuple(int(s) for s in segments) if segments else None

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A plain buffer (FSDP2 writes its collective's input and output there)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bits={self.bits}, block={self.block})"


class QuantizedAllGather(_Quantized, AllGather):
    """FSDP2's parameter all-gather with each rank's shard sent as symmetric int8 per block.

    A rank's own slice of the output stays exact; the others are dequantized (error per block
    at most max|x|/254, see ``compressed.fsdp.quantize``). ``segments``: the shard's parameter
    sizes (``quantize_comms`` passes them) so that no block spans two parameters. A byte
    buffer (FSDP2's layout for mixed parameter dtypes) is gathered exactly.
    """

    def __init__(self, bits: int = 8, block: int = DEFAULT_BLOCK,
                 segments: Sequence[int] | None = None) -> None:
        super().__init__(bits, block, segments, "QuantizedAllGather", (8,))

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        """Gather every rank's ``input_tensor`` into ``output_tensor`` (rank order), as FSDP2."""
        world, rank = group.size(), group.rank()
        n = input_tensor.numel()
        if output_tensor.numel() != world * n:
            raise ValueError(f"QuantizedAllGather: expected an output of {world} x {n} elements "
                             f"(group size x input), got {output_tensor.numel()}")
        if not output_tensor.dtype.is_floating_point:
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                               async_op=async_op)
        out = output_tensor.view(world, n)
        if out[rank].data_ptr() != input_tensor.data_ptr():
            out[rank].copy_(input_tensor.reshape(-1))
        if world == 1 or n == 0:
            return _Done() if async_op else None
        lay = _row_layout(n, self.block, self.segments)
        row = quantize_rows(input_tensor.reshape(1, n), lay)
        gathered = torch.empty(world, lay.nbytes, dtype=torch.uint8, device=row.device)

        comm = _communicator(group, async_op)

        def start(async_: bool):
            if comm is not None:
                return comm.all_gather_into_tensor(gathered, row)
            return dist.all_gather_into_tensor(gathered, row, group=group, async_op=async_)

        def dequantize() -> None:
            dequantize_into(gathered, lay, out, skip=rank)
        return _finish(start, dequantize, async_op)


class QuantizedReduceScatter(_Quantized, ReduceScatter):
    """FSDP2's gradient reduce-scatter with the chunk bound for each peer sent as int8 per block.

    An all-to-all moves the int8 chunks and scales; each rank sums, in fp32 and rank order, its
    own chunk (exact) and the dequantized chunks of its peers, applies the op (SUM, AVG, or
    FSDP2's PREMUL_SUM divide factor) and writes its shard in the reduce dtype.
    """

    def __init__(self, bits: int = 8, block: int = DEFAULT_BLOCK,
                 segments: Sequence[int] | None = None) -> None:
        super().__init__(bits, block, segments, "QuantizedReduceScatter", (8,))

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op=dist.ReduceOp.SUM,
                 async_op: bool = False) -> dist.Work | None:
        """Reduce ``input_tensor`` (world x shard) over ranks; this rank's shard to ``output``."""
        world, rank = group.size(), group.rank()
        m = output_tensor.numel()
        if input_tensor.numel() != world * m:
            raise ValueError(f"QuantizedReduceScatter: expected an input of {world} x {m} "
                             f"elements (group size x output), got {input_tensor.numel()}")
        if not input_tensor.dtype.is_floating_point:
            raise ValueError("QuantizedReduceScatter: expected floating-point gradients, got "
                             f"{input_tensor.dtype}")
        factor = _op_factor(op, world)
        chunks = input_tensor.reshape(world, m)
        if world == 1 or m == 0:
            _write(output_tensor, chunks[rank].float(), factor)
            return _Done() if async_op else None
        lay = _row_layout(m, self.block, self.segments)
        send = quantize_rows(chunks, lay)
        recv = torch.empty_like(send)

        comm = _communicator(group, async_op)

        def start(async_: bool):
            if comm is not None:
                return comm.all_to_all_single(recv, send)
            return dist.all_to_all_single(recv, send, group=group, async_op=async_)
        own = chunks[rank]

        def reduce() -> None:
            total = reduce_rows(recv, lay, own, rank, 1.0 if factor is None else factor)
            output_tensor.view(-1).copy_(total)
        return _finish(start, reduce, async_op)


def _op_factor(op, world: int) -> float | None:
    """The factor the sum is multiplied by: None (SUM), 1/world (AVG), PREMUL_SUM's factor."""
    kind = getattr(op, "op", op)
    if kind == _RED.SUM:
        return None
    if kind == _RED.AVG:
        return 1.0 / world
    if kind == _RED.PREMUL_SUM:
        factor = op.factor
        return float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    name = getattr(kind, "name", str(kind))
    raise ValueError(f"QuantizedReduceScatter: expected reduce op SUM or AVG (or FSDP2's "
                     f"PREMUL_SUM divide factor), got {name}")


def _write(output: torch.Tensor, total: torch.Tensor, factor: float | None) -> None:
    if factor is not None:
        total = total * factor
    output.view(-1).copy_(total)
