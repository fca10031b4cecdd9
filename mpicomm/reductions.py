"""The Communicator's reductions: all_reduce, reduce, reduce_scatter_tensor (a mixin on its launch path).

Each validates, adapts the buffers and calls MPI's reduction (in pieces past MPI's counts); 16-bit
SUM, AVG, MAX and MIN go through ``reduce16`` (16 bits on the wire). ``factor`` is PREMUL_SUM,
the sum scaled by a factor, and it lives here only: a 16-bit tensor's float32 sum is multiplied
by it before the one rounding (the ``reduce16`` kernel), any other dtype is multiplied by it
first (:func:`premultiplied`) and then summed.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from mpi4py import MPI

from . import fastpath, large, reduce16
from .buffers import IN, INOUT, OUT, Slot, host_overlap, prepare, to_tensor
from .checking import agree, signature
from .device_paths import DevicePolicy
from .errors import check_rank, check_type, describe, fail_value
from .observe import observed_as
from .ops import ReduceOp, parse_op
from .requests import Requests
from .validate import out_and_in, reduction
from .work import Work

def premultiplied(tensor: torch.Tensor, factor) -> torch.Tensor:
    """``tensor * factor`` in a new tensor of the same dtype (PREMUL_SUM's local step)."""
    if isinstance(factor, torch.Tensor):
        factor = factor.to(device=tensor.device)
    return torch.mul(tensor, factor).to(tensor.dtype)


def _op_and_factor(call: str, op, factor) -> tuple[ReduceOp, float | torch.Tensor | None]:
    """(ReduceOp, factor) checked: any op, or op SUM with a factor that is a number or a
    one-element tensor (or raise)."""
    op = parse_op(op, call)
    if factor is None:
        return op, None
    number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
    check_type(call, "factor", factor, "None, a number or a one-element tensor",
               ok=number or (isinstance(factor, torch.Tensor) and factor.numel() == 1))
    if op is not ReduceOp.SUM:
        fail_value(call, "op", "ReduceOp.SUM with a factor (the factor scales the sum)", str(op))
    return op, factor


def _scalar(factor) -> float:
    """A factor (a number or a one-element tensor) as a float."""
    return float(factor.item() if isinstance(factor, torch.Tensor) else factor)


class Reductions:
    """all_reduce, reduce and reduce_scatter_tensor of torch tensors, numpy and cupy arrays."""

    # -- plumbing ---------------------------------------------------------------------------

    def _policy16(self) -> DevicePolicy:
        """Which device buffers the 16-bit reductions hand to MPI directly (see reduce16); asked
        for device buffers only, so it follows the communicator's policy without a cache."""
        return reduce16.device_policy(self.device_policy())

    def _reduce16(self) -> reduce16.State:
        """State of the 16-bit reductions (their private communicator is made on first use)."""
        if self._r16 is None:
            self._r16 = reduce16.State(self.mpi_comm, self._tag_ub)
        return self._r16

    def _plan16(self, t: torch.Tensor, op: ReduceOp, factor) -> tuple | None:
        """The 16-bit reduction's plan for ``t`` (None: not a 16-bit reduction done by reduce16)."""
        if t.dtype not in reduce16.DTYPES:
            return None
        return reduce16.plan_op(op, self.size, None if factor is None else _scalar(factor))

    def _launch16(self, steps: Requests, slots: Sequence[Slot], async_op: bool,
                  result: Sequence):
        """Finish (or hand to a Work) a started 16-bit reduction."""
        return self._launch(steps.Wait, lambda: steps, (), slots, async_op, result)

    def _launch_pieces(self, blocking: Callable, nonblocking: Callable, count: int, args: Callable,
                       slots: Sequence[Slot], async_op: bool, result: Sequence):
        """Like _launch, one MPI call per piece of ``count`` elements (see mpicomm.large)."""
        run, start = large.in_pieces(blocking, nonblocking, count, args)
        return self._launch(run, start, (), slots, async_op, result)

    # -- the calls --------------------------------------------------------------------------

    @fastpath.all_reduce
    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op: bool = False,
                   factor: float | torch.Tensor | None = None) -> Work | None:
        """Reduce ``tensor`` across ranks, in place; ``factor`` (op SUM): the sum times it."""
        return self._all_reduce(tensor, op, async_op, factor)

    @observed_as("all_reduce")
    def _all_reduce(self, tensor, op, async_op, factor=None):
        call = "all_reduce"
        op, factor = _op_and_factor(call, op, factor)
        t = to_tensor(tensor, call, "tensor", writable=True)
        mpi_type, wire, mpi_op = reduction(call, t.dtype, op)
        if self.check:
            agree(self.mpi_comm, call, f"op={op}, tensor={signature(t)}")
        plan = self._plan16(t, op, factor)
        if plan is not None:
            slot = prepare(t, INOUT, MPI.UINT16_T, t.dtype, self._policy16, call)
            return self._launch16(reduce16.all_reduce(self._reduce16(), slot.work, plan),
                                  [slot], async_op, [tensor])
        if factor is not None:
            t.copy_(premultiplied(t, factor))
        slot = prepare(t, INOUT, mpi_type, wire, self.device_policy,
                       "iallreduce" if async_op else "allreduce")
        if op is ReduceOp.AVG:
            slot.scale = self.size
        comm, spec = self.mpi_comm, slot.spec
        if large.too_big(t.numel()):
            return self._launch_pieces(
                comm.Allreduce, comm.Iallreduce, t.numel(),
                lambda start, n: (MPI.IN_PLACE, large.piece(spec, start, n), mpi_op),
                [slot], async_op, [tensor])
        return self._launch(comm.Allreduce, comm.Iallreduce, (MPI.IN_PLACE, spec, mpi_op),
                            [slot], async_op, [tensor])

    def reduce(self, tensor, dst: int = 0, op=ReduceOp.SUM, async_op: bool = False,
               factor: float | torch.Tensor | None = None) -> Work | None:
        """Reduce ``tensor`` across ranks into ``tensor`` on rank ``dst`` (others keep theirs);
        ``factor`` (op SUM): the sum times it."""
        return self._reduce(tensor, dst, op, async_op, factor)

    @observed_as("reduce")
    def _reduce(self, tensor, dst, op, async_op, factor=None):
        call = "reduce"
        op, factor = _op_and_factor(call, op, factor)
        dst = check_rank(call, "dst", dst, self.size)
        t = to_tensor(tensor, call, "tensor", writable=True)
        mpi_type, wire, mpi_op = reduction(call, t.dtype, op)
        if self.check:
            agree(self.mpi_comm, call, f"op={op}, dst={dst}, tensor={signature(t)}")
        root = self.rank == dst
        plan = self._plan16(t, op, factor)
        if plan is not None:
            slot = prepare(t, INOUT if root else IN, MPI.UINT16_T, t.dtype, self._policy16,
                           call)
            return self._launch16(reduce16.reduce(self._reduce16(), slot.work, dst, plan),
                                  [slot], async_op, [tensor])
        if factor is not None:  # in place on the root; the others keep theirs
            if root:
                t.copy_(premultiplied(t, factor))
            else:
                t = premultiplied(t, factor)
        slot = prepare(t, INOUT if root else IN, mpi_type, wire, self.device_policy,
                       "ireduce" if async_op else "reduce")
        if op is ReduceOp.AVG and root:
            slot.scale = self.size
        comm, spec = self.mpi_comm, slot.spec

        def args(start, n):
            part = large.piece(spec, start, n) if n >= 0 else spec
            return (MPI.IN_PLACE, part, mpi_op, dst) if root else (part, None, mpi_op, dst)

        if large.too_big(t.numel()):
            return self._launch_pieces(comm.Reduce, comm.Ireduce, t.numel(), args, [slot],
                                       async_op, [tensor])
        return self._launch(comm.Reduce, comm.Ireduce, args(0, -1), [slot], async_op, [tensor])

    @fastpath.reduce_scatter_tensor
    def reduce_scatter_tensor(self, output, input, op=ReduceOp.SUM, async_op: bool = False,
                              factor: float | torch.Tensor | None = None) -> Work | None:
        """Reduce ``input`` across ranks; rank r receives the r-th of ``size`` equal chunks in
        ``output``; ``factor`` (op SUM): the sum times it."""
        return self._reduce_scatter_tensor(output, input, op, async_op, factor)

    @observed_as("reduce_scatter_tensor")
    def _reduce_scatter_tensor(self, output, input, op, async_op, factor=None):
        call = "reduce_scatter_tensor"
        op, factor = _op_and_factor(call, op, factor)
        out, inp = out_and_in(call, ("output", "input"), output, input)
        if inp.numel() != self.size * out.numel():
            fail_value(call, "input", f"{self.size} x output.numel() = {self.size * out.numel()} "
                       "elements", f"{inp.numel()} ({describe(input)})")
        mpi_type, wire, mpi_op = reduction(call, inp.dtype, op)
        if self.check:
            agree(self.mpi_comm, call,
                  f"op={op}, output={signature(out)}, input={signature(inp)}")
        mpi_call = "ireduce_scatter_block" if async_op else "reduce_scatter_block"
        plan = self._plan16(inp, op, factor)
        if factor is not None and plan is None:
            inp = premultiplied(inp, factor)  # a new tensor: the input is left unchanged
        elif host_overlap(out, inp):
            inp = inp.clone()
        if plan is not None:
            send = prepare(inp, IN, MPI.UINT16_T, inp.dtype, self._policy16, call)
            recv = prepare(out, OUT, MPI.UINT16_T, out.dtype, self._policy16, call)
            return self._launch16(
                reduce16.reduce_scatter(self._reduce16(), recv.work, send.work, plan),
                [send, recv], async_op, [output])
        send = prepare(inp, IN, mpi_type, wire, self.device_policy, mpi_call)
        recv = prepare(out, OUT, mpi_type, wire, self.device_policy, mpi_call)
        if op is ReduceOp.AVG:
            recv.scale = self.size
        if large.too_big(out.numel()):
            run, start = large.reduce_scatter_pieces(self.mpi_comm, send.spec, recv.spec,
                                                     out.numel(), mpi_op)
            return self._launch(run, start, (), [send, recv], async_op, [output])
        return self._launch(self.mpi_comm.Reduce_scatter_block, self.mpi_comm.Ireduce_scatter_block,
                            (send.spec, recv.spec, mpi_op), [send, recv], async_op, [output])
