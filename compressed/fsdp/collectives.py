"""FSDP2 custom collectives that move int8 per block: the weight all-gather and the gradient
reduce-scatter (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``); the
reduce-scatter also as 1-bit signs with error feedback (``bits=1``, ``onebit``).

Both run on any torch.distributed process group (mpicomm, gloo, NCCL): the payload is one
uint8 tensor on the caller's device moved by ``all_gather_into_tensor`` / ``all_to_all_single``.
With ``async_op=True`` they return a work whose ``wait()`` waits for the transfer and then
dequantizes into FSDP2's output. On the CPU (fp32 / bf16) the fused numba kernels read and
write FSDP2's tensors in place and the packed rows live in pooled buffers (``wires``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from . import wires
from .onebit import OnebitState, check_warmup
from .quantize import Layout, _numba, dequantize_into, layout, quantize_rows, reduce_rows

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


class _LaterWork(dist.Work):
    """The work of a 1-bit call in flight (``onebit.InFlight``): ``wait()`` finishes it (waits
    for the transfer, writes the result; its error raised there)."""

    def __init__(self, call) -> None:
        super().__init__()
        self._call = call

    def wait(self, timeout=None) -> bool:
        self._call()
        return True

    def is_completed(self) -> bool:
        return self._call.done

    def is_success(self) -> bool:
        return self._call.done


class _Done(dist.Work):
    """A work already finished (nothing to move: a group of one)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


_MPICOMM_PG: list = []  # [the mpicomm process group class, or None], once looked up


def _communicator(group: dist.ProcessGroup, async_op: bool):
    """The mpicomm Communicator under ``group`` for a blocking call, else None.

    A blocking call on an mpicomm process group goes to its Communicator directly (one MPI
    call, ~100 us less per call at 16-64 KiB than the process group's work); it waits in MPI
    without the group's timeout. Async calls and other groups keep the process group's path.
    """
    if async_op:
        return None
    if not _MPICOMM_PG:
        try:
            from mpicomm.distributed._pg import MpicommProcessGroup
        except ImportError:
            MpicommProcessGroup = None
        _MPICOMM_PG.append(MpicommProcessGroup)
    cls = _MPICOMM_PG[0]
    if cls is None or not isinstance(group, cls) or group.comm is None or group._broken:
        return None  # a destroyed or broken group: its own path raises the clear error
    return group.comm


def _host(t: torch.Tensor, rows: int):
    """``(numpy (rows, -1) view, bf16 bits?)`` of a contiguous fp32 / bf16 CPU tensor, else
    None (other dtypes and devices take the torch path)."""
    if t.dtype == torch.float32 and t.is_cpu and t.is_contiguous():
        return t.numpy().reshape(rows, -1), False
    if t.dtype == torch.bfloat16 and t.is_cpu and t.is_contiguous():
        return t.view(torch.uint16).numpy().reshape(rows, -1), True
    return None


def _move(start: Callable[[bool], dist.Work | None], then: Callable[[], None],
          wire: wires.Wire, async_op: bool):
    """``_finish`` that gives ``wire`` back to the pool once ``then`` has run."""
    def then_release() -> None:
        try:
            then()
        finally:
            wires.release(wire)
    return _finish(start, then_release, async_op)


def _starter(collective: str, comm, group: dist.ProcessGroup, output: torch.Tensor,
             input: torch.Tensor) -> Callable[[bool], dist.Work | None]:
    """``start(async_)`` of the (output, input) ``collective``: the mpicomm Communicator's
    ``comm`` when given (a blocking call, see ``_communicator``), else torch.distributed's on
    ``group``."""
    def start(async_: bool):
        if comm is not None:
            return getattr(comm, collective)(output, input)
        return getattr(dist, collective)(output, input, group=group, async_op=async_)
    return start


def _finish(start: Callable[[bool], dist.Work | None], then: Callable[[], None], async_op: bool):
    """Start the transfer (blocking unless ``async_op``); run ``then`` now or in the work's
    ``wait()``."""
    if async_op:
        return _ThenWork(start(True), then)
    start(False)
    then()
    return None


def _per_rank(full: torch.Tensor, part: torch.Tensor, world: int, what: str, full_name: str,
              part_name: str) -> int:
    """``part``'s element count, after checking that ``full`` holds ``world`` times it."""
    k = part.numel()
    if full.numel() != world * k:
        raise ValueError(f"{what}: expected an {full_name} of {world} x {k} elements (group "
                         f"size x {part_name}), got {full.numel()}")
    return k


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
        self._layouts: dict[int, Layout] = {}

    def _layout(self, n: int) -> Layout:
        """The row layout for rows of ``n`` (kept per instance)."""
        lay = self._layouts.get(n)
        if lay is None:
            lay = self._layouts[n] = _row_layout(n, self.block, self.segments)
        return lay

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
        n = _per_rank(output_tensor, input_tensor, world, "QuantizedAllGather", "output", "input")
        if not output_tensor.dtype.is_floating_point:
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                               async_op=async_op)
        if output_tensor.is_neg():
            raise ValueError("QuantizedAllGather: output_tensor has torch's negative bit set "
                             "(is_neg()): pass a plain tensor (t.resolve_neg())")
        if input_tensor.is_neg():
            input_tensor = input_tensor.resolve_neg()  # a copy with the negation applied
        itemsize = output_tensor.element_size()
        if (output_tensor.is_contiguous() and input_tensor.is_contiguous()
                and output_tensor.data_ptr() + rank * n * itemsize == input_tensor.data_ptr()):
            pass  # FSDP2's case: the input already is this rank's slice of the output
        else:
            output_tensor.view(world, n)[rank].copy_(input_tensor.reshape(-1))
        if world == 1 or n == 0:
            return _Done() if async_op else None
        lay = self._layout(n)
        comm = _communicator(group, async_op)
        kernels = _numba(input_tensor) if input_tensor.dtype == output_tensor.dtype else None
        x = _host(input_tensor, 1) if kernels is not None else None
        out = _host(output_tensor, world) if x is not None else None
        if out is not None:  # the CPU path: fused kernels on reused buffers
            wire = wires.acquire(lay, 1, world)
            (kernels.quantize_bf16 if x[1] else kernels.quantize)(
                x[0], lay.edges, wire.send_scale, wire.send_q, -1)

            def dequantize() -> None:
                (kernels.dequantize_bf16 if out[1] else kernels.dequantize)(
                    wire.recv_scale, wire.recv_q, lay.edges, out[0], rank)
            return _move(_starter("all_gather_into_tensor", comm, group, wire.recv, wire.send),
                         dequantize, wire, async_op)
        row = quantize_rows(input_tensor.reshape(1, n), lay)
        gathered = torch.empty(world, lay.nbytes, dtype=torch.uint8, device=row.device)

        def dequantize() -> None:
            dequantize_into(gathered, lay, output_tensor.view(world, n), skip=rank)
            _used_here(gathered)
        return _finish(_starter("all_gather_into_tensor", comm, group, gathered, row),
                       dequantize, async_op)


class QuantizedReduceScatter(_Quantized, ReduceScatter):
    """FSDP2's gradient reduce-scatter with the chunk bound for each peer sent as int8 per block
    (``bits=8``) or as signs with error feedback (``bits=1``).

    ``bits=8``: an all-to-all moves the int8 chunks and scales; each rank sums, in fp32 and
    rank order, its own chunk (exact) and the dequantized chunks of its peers, applies the op
    (SUM, AVG, or FSDP2's PREMUL_SUM divide factor) and writes its shard in the reduce dtype.

    ``bits=1``: the 1-bit engine's reduce-scatter phase (``compressed.fsdp.onebit``): one scale
    per rank and call, the worker error kept by this object (``state_dict()``), so each
    FSDPModule needs its own; at one rank the gradient passes exactly. With ``async_op=True``
    the signs are packed and posted at the call (the transfer progressing on the process
    group's own async path) and the work's ``wait()`` sums them and updates the error; a
    second call of the same object first finishes the one in flight. ``warmup_steps`` (bits=1
    only; 0 here, ``quantize_comms`` gives 20 by default): the first calls run as full-precision
    reduce-scatters (SUM at the input's dtype, then the op's factor), the error starting at zero
    with the first 1-bit call; the call count is in ``state_dict()``.
    """

    def __init__(self, bits: int = 8, block: int = DEFAULT_BLOCK,
                 segments: Sequence[int] | None = None, warmup_steps: int = 0) -> None:
        super().__init__(bits, block, segments, "QuantizedReduceScatter", (8, 1))
        warmup = check_warmup(warmup_steps, self.bits, "QuantizedReduceScatter", 0)
        self.onebit = OnebitState(warmup) if self.bits == 1 else None

    def state_dict(self) -> dict:
        """The 1-bit worker error (``OnebitState.state_dict``); empty for ``bits=8``."""
        return self.onebit.state_dict() if self.onebit is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Take what ``state_dict`` gave (at the same rank count and shard size)."""
        if self.onebit is not None:
            self.onebit.load_state_dict(state)
        elif state:
            raise ValueError("QuantizedReduceScatter(bits=8) keeps no state; got "
                             f"{sorted(state)}")

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op=dist.ReduceOp.SUM,
                 async_op: bool = False) -> dist.Work | None:
        """Reduce ``input_tensor`` (world x shard) over ranks; this rank's shard to ``output``."""
        direct = _communicator(group, async_op)
        world, rank = (group.size(), group.rank()) if direct is None else (direct.size, direct.rank)
        m = _per_rank(input_tensor, output_tensor, world, "QuantizedReduceScatter", "input",
                      "output")
        if not input_tensor.dtype.is_floating_point:
            raise ValueError("QuantizedReduceScatter: expected floating-point gradients, got "
                             f"{input_tensor.dtype}")
        factor = _op_factor(op, world)
        warm = False
        if self.onebit is not None:
            self.onebit.shape_check(world, m)
            warm = self.onebit.count_step()
        if world == 1 or m == 0:
            _write(output_tensor, input_tensor.reshape(world, m)[rank].float(), factor)
            return _Done() if async_op else None
        if warm:
            return _full_precision(output_tensor, input_tensor, group, direct, factor, async_op)
        if self.onebit is not None:
            kind = getattr(op, "op", op)
            mult = 1.0 if kind == _RED.AVG else world * (1.0 if factor is None else factor)
            call = self.onebit.reduce_scatter(output_tensor, input_tensor, group, direct, mult,
                                              async_op)
            return _LaterWork(call) if async_op else None
        lay = self._layout(m)
        kernels = _numba(input_tensor)
        x = _host(input_tensor, world) if kernels is not None else None
        out = _host(output_tensor, 1) if x is not None else None
        if out is not None:  # the CPU path: fused kernels on reused buffers
            wire = wires.acquire(lay, world, world)
            # this rank's own chunk is never sent: its row stays as it is
            (kernels.quantize_bf16 if x[1] else kernels.quantize)(
                x[0], lay.edges, wire.send_scale, wire.send_q, rank)

            def reduce() -> None:
                kernels.reduce_into(wire.recv_scale, wire.recv_q, lay.edges, x[0][rank], x[1],
                                    rank, 1.0 if factor is None else factor, out[0][0], out[1])
            return _move(_starter("all_to_all_single", direct, group, wire.recv, wire.send),
                         reduce, wire, async_op)
        chunks = input_tensor.reshape(world, m)
        send = quantize_rows(chunks, lay)
        recv = torch.empty_like(send)
        own = chunks[rank]

        def reduce() -> None:
            total = reduce_rows(recv, lay, own, rank, 1.0 if factor is None else factor)
            output_tensor.view(-1).copy_(total)
            _used_here(recv)
        return _finish(_starter("all_to_all_single", direct, group, recv, send), reduce, async_op)


def _full_precision(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                    direct, factor: float | None, async_op: bool):
    """The 1-bit warm-up's reduce-scatter: a SUM at the input's dtype on the group (``direct``:
    its mpicomm Communicator), then the op's factor, into ``output``."""
    inp = input.reshape(-1) if input.is_contiguous() else input.contiguous().view(-1)
    into = (output.is_contiguous() and output.dtype == inp.dtype and not output.is_neg())
    out = output.view(-1) if into else torch.empty(output.numel(), dtype=inp.dtype,
                                                   device=inp.device)

    def then() -> None:
        if factor is not None:
            out.mul_(factor)
        if not into:
            output.view(-1).copy_(out)
    return _finish(_starter("reduce_scatter_tensor", direct, group, out, inp), then, async_op)


def _used_here(t: torch.Tensor) -> None:
    """Tell the CUDA caching allocator that ``t`` was read on the current stream (an async
    work's ``wait()`` may run on another stream than the call), so that freeing it does not
    hand its memory to the call's stream before the reading kernel has run."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))


def _op_factor(op, world: int) -> float | None:
    """The factor the sum is multiplied by: None (SUM), 1/world (AVG), PREMUL_SUM's factor."""
    kind = getattr(op, "op", op)
    if kind == _RED.SUM:
        return None
    if kind == _RED.AVG:
        return 1.0 / world
    if kind == _RED.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:  # torch before 2.13 keeps the factor in C++ only
            raise ValueError("QuantizedReduceScatter: this torch "
                             f"({torch.__version__}) does not expose PREMUL_SUM's factor "
                             "(ReduceOp.factor, torch >= 2.13); use SUM or AVG (FSDP2 passes "
                             "PREMUL_SUM only after set_gradient_divide_factor)")
        return float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    name = getattr(kind, "name", str(kind))
    raise ValueError(f"QuantizedReduceScatter: expected reduce op SUM or AVG (or FSDP2's "
                     f"PREMUL_SUM divide factor), got {name}")


def _write(output: torch.Tensor, total: torch.Tensor, factor: float | None) -> None:
    if factor is not None:
        total = total * factor
    output.view(-1).copy_(total)
