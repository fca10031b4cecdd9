"""The Communicator: torch.distributed-style collectives on one MPI communicator.

Every collective follows the same path: validate the arguments (errors raised before any MPI
call), optionally agree across ranks (checking mode), adapt each buffer for MPI (zero-copy when
possible; otherwise contiguous, upcast or staged copies), call MPI's blocking or non-blocking
primitive, and put results back into the caller's buffers when the call completes.
"""
from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch
from mpi4py import MPI

from . import fastpath, large, reduce16
from accelerators.flags import env_flag
from .buffers import IN, INOUT, OUT, Slot, host_overlap, prepare, to_tensor
from .checking import agree
from .device_paths import DevicePolicy
from .errors import check_rank, check_type, describe, fail_value
from .observe import _DEBUG, _debug_cache, _profiler, log_init, observed, observed_as
from .observe import log as _log
from .ops import ReduceOp, parse_op
from .p2p import PointToPoint
from .validate import move_type, per_rank_list, reduction, root_list, same_device, same_dtype, splits
from .work import Work

_world: "Communicator | None" = None
_Tensor = torch.Tensor
_IN_PLACE = MPI.IN_PLACE
_fromaddress = MPI.buffer.fromaddress
_FAST_REDUCE = fastpath.REDUCE
_SUM = ReduceOp.SUM
#: all_reduce remembers its last fast call on a tensor of at most this many bytes (holding a
#: reference to it until the next fast call): measured at 2 ranks, 8 bytes, ~0.5 us per call
#: less when the same tensor comes again, ~0.15 us more of CPU time when it does not.
REMEMBER_BYTES = 1 << 16
_NOTHING = object()  # no call remembered (never a caller's argument)
_FAST_SUM = {dtype: found for (dtype, op), found in _FAST_REDUCE.items() if op is _SUM}


def _node_rank(mpi_comm: MPI.Intracomm) -> tuple[int, int]:
    """(local rank, ranks of ``mpi_comm`` on this node), local rank as the accelerator layer says.

    Launcher variable first, the shared-memory split as the fallback (collective over
    ``mpi_comm``); on the world, a warning when the node's local ranks are not each of 0..n-1.
    """
    from accelerators import LocalRankWarning, detect_local_rank, get_accelerator
    from accelerators.local_rank import numbering_problem

    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        acc = get_accelerator()
        if MPI.Comm.Compare(mpi_comm, MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT):
            local = acc.local_rank()
            problem = numbering_problem(node.allgather(local.rank), local.source)
            if problem is not None:
                warnings.warn(problem, LocalRankWarning, stacklevel=3)
        else:  # the launcher's answer (per process) when there is one, else this split, never
               # a collective over the world (not every world rank is here)
            local = detect_local_rank(explicit=acc._explicit_local_rank,
                                      shared_split=lambda: (node.Get_rank(), node.Get_size()))
        return local.rank, node.Get_size()
    finally:
        node.Free()


def _sig(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


class Communicator(PointToPoint):
    """Collectives over torch tensors, numpy and cupy arrays on one MPI communicator.

    ``check=True`` (or ``MPICOMM_CHECK=1``) makes the ranks agree on each collective's op,
    shapes, dtypes and root before calling MPI, so a mismatch raises on every rank instead of
    hanging or corrupting data.

    ``local_rank`` is this process's rank on its node as the accelerator layer numbers it
    (launcher variable first, shared-memory split as the fallback; it picks the device);
    ``local_size`` counts this communicator's ranks on the node.
    """

    def __init__(self, mpi_comm: MPI.Comm = MPI.COMM_WORLD, check: bool | None = None) -> None:
        check_type("Communicator", "mpi_comm", mpi_comm, "an mpi4py intracommunicator",
                   ok=isinstance(mpi_comm, MPI.Intracomm) and mpi_comm != MPI.COMM_NULL)
        self.mpi_comm = mpi_comm
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        self.local_rank, self.local_size = _node_rank(mpi_comm)
        self.check: bool = env_flag("MPICOMM_CHECK") if check is None else bool(check)
        self._policy: DevicePolicy | None = None
        self._tag_ub: int = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self._r16: reduce16.State | None = None
        # all_reduce's last fast call: (tensor, op, address, nbytes, dtype, MPI buffer, MPI op)
        self._last_fast: tuple = (_NOTHING,) * 7

    def __repr__(self) -> str:
        return f"<mpicomm.Communicator rank {self.rank} of {self.size}>"

    # -- plumbing ---------------------------------------------------------------------------

    def device_policy(self) -> DevicePolicy:
        """Which MPI calls take device buffers directly (decided once, on first device buffer)."""
        if self._policy is None:
            self._policy = DevicePolicy.detect()
        return self._policy

    def _launch(self, blocking: Callable, nonblocking: Callable, args: tuple, slots: Sequence[Slot],
                async_op: bool, result: Sequence, extra: Sequence[Callable[[], None]] = ()):
        """Run one MPI primitive (blocking or not) and put the results back on completion."""
        finish = [s.finish for s in slots if s.has_finish]
        finish.extend(extra)
        try:
            if async_op:
                return Work(nonblocking(*args), finish, result, keep=slots)
            blocking(*args)
        except BaseException:
            for s in slots:
                s.role = IN  # release staging memory without writing anything back
                s.finish()
            raise
        for step in finish:
            step()
        return None

    def _policy16(self) -> DevicePolicy:
        """Which device buffers the 16-bit reductions hand to MPI directly (see reduce16); asked
        for device buffers only, so it follows the communicator's policy without a cache."""
        return reduce16.device_policy(self.device_policy())

    def _reduce16(self) -> reduce16.State:
        """State of the 16-bit reductions (their private communicator is made on first use)."""
        if self._r16 is None:
            self._r16 = reduce16.State(self.mpi_comm, self._tag_ub)
        return self._r16

    def _launch16(self, steps: reduce16.Steps, slots: Sequence[Slot], async_op: bool,
                  result: Sequence):
        """Finish (or hand to a Work) a started 16-bit reduction."""
        return self._launch(steps.Wait, lambda: steps, (), slots, async_op, result)

    def _launch_pieces(self, blocking: Callable, nonblocking: Callable, count: int, args: Callable,
                       slots: Sequence[Slot], async_op: bool, result: Sequence):
        """Like _launch, one MPI call per piece of ``count`` elements (see mpicomm.large)."""
        run, start = large.in_pieces(blocking, nonblocking, count, args)
        return self._launch(run, start, (), slots, async_op, result)

    # -- reductions -------------------------------------------------------------------------

    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` across ranks, in place."""
        # The fast-path rule (mpicomm.fastpath) inlined: one Python frame between the caller
        # and MPI's Allreduce for a contiguous host tensor MPI reduces natively.
        if (not async_op and not self.check and fastpath.ENABLED
                and not _profiler._is_profiler_enabled
                and (_debug_cache.get(_DEBUG) is False or not _log.isEnabledFor(_DEBUG))):
            last = self._last_fast
            # The small tensor and op of the last fast call again (a flag, a metric, a bucket
            # reduced step after step): its MPI buffer is reused while the tensor keeps the
            # same memory, size, dtype and layout, which is checked on every call.
            if (tensor is last[0] and op is last[1] and tensor.data_ptr() == last[2]
                    and tensor.nbytes == last[3] and tensor.dtype is last[4]
                    and tensor.is_contiguous() and tensor.is_cpu):
                self.mpi_comm.Allreduce(_IN_PLACE, last[5], last[6])
                return None
            if type(tensor) is _Tensor and tensor.is_cpu and tensor.is_contiguous():
                dtype = tensor.dtype
                if op is _SUM:  # the default: a dtype-only table (hashing an enum costs ~0.3 us)
                    found = _FAST_SUM.get(dtype)
                else:
                    try:
                        found = _FAST_REDUCE.get((dtype, op))
                    except TypeError:  # an unhashable op: the general path reports it
                        found = None
                # bytes <= MAX_COUNT implies elements <= MAX_COUNT (bigger: the general path)
                if found is not None and (nbytes := tensor.nbytes) <= large.MAX_COUNT:
                    ptr = tensor.data_ptr()
                    spec = [_fromaddress(ptr, nbytes), found[0]]
                    self.mpi_comm.Allreduce(_IN_PLACE, spec, found[1])
                    if nbytes <= REMEMBER_BYTES:
                        self._last_fast = (tensor, op, ptr, nbytes, dtype, spec, found[1])
                    return None
        return self._all_reduce(tensor, op, async_op)

    @observed_as("all_reduce")
    def _all_reduce(self, tensor, op, async_op, factor=None):
        """``factor``: PREMUL_SUM of a 16-bit tensor (the float32 sum times it, rounded once)."""
        call = "all_reduce"
        op = parse_op(op, call)
        t = to_tensor(tensor, call, "tensor", writable=True)
        mpi_type, wire, mpi_op = reduction(call, t.dtype, op)
        if self.check:
            agree(self.mpi_comm, call, f"op={op}, tensor={_sig(t)}")
        plan = reduce16.plan_op(op, self.size, factor) if t.dtype in reduce16.DTYPES else None
        if plan is not None:
            slot = prepare(t, INOUT, MPI.UINT16_T, t.dtype, self._policy16, call)
            return self._launch16(reduce16.all_reduce(self._reduce16(), slot.work, plan),
                                  [slot], async_op, [tensor])
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

    def reduce(self, tensor, dst: int = 0, op=ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` across ranks into ``tensor`` on rank ``dst`` (others keep theirs)."""
        return self._reduce(tensor, dst, op, async_op)

    @observed_as("reduce")
    def _reduce(self, tensor, dst, op, async_op, factor=None):
        call = "reduce"
        op = parse_op(op, call)
        dst = check_rank(call, "dst", dst, self.size)
        t = to_tensor(tensor, call, "tensor", writable=True)
        mpi_type, wire, mpi_op = reduction(call, t.dtype, op)
        if self.check:
            agree(self.mpi_comm, call, f"op={op}, dst={dst}, tensor={_sig(t)}")
        root = self.rank == dst
        plan = reduce16.plan_op(op, self.size, factor) if t.dtype in reduce16.DTYPES else None
        if plan is not None:
            slot = prepare(t, INOUT if root else IN, MPI.UINT16_T, t.dtype, self._policy16,
                           call)
            return self._launch16(reduce16.reduce(self._reduce16(), slot.work, dst, plan),
                                  [slot], async_op, [tensor])
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

    def reduce_scatter_tensor(self, output, input, op=ReduceOp.SUM,
                              async_op: bool = False) -> Work | None:
        """Reduce ``input`` across ranks; rank r receives the r-th of ``size`` equal chunks in ``output``."""
        if (not async_op and not self.check
                and fastpath.run(self, "reduce_scatter_tensor", output, input, op=op)):
            return None
        return self._reduce_scatter_tensor(output, input, op, async_op)

    @observed_as("reduce_scatter_tensor")
    def _reduce_scatter_tensor(self, output, input, op, async_op, factor=None):
        call = "reduce_scatter_tensor"
        op = parse_op(op, call)
        out = to_tensor(output, call, "output", writable=True)
        inp = to_tensor(input, call, "input", writable=False)
        same_dtype(call, "output", out, inp)
        same_device(call, "output", out, inp)
        if inp.numel() != self.size * out.numel():
            fail_value(call, "input", f"{self.size} x output.numel() = {self.size * out.numel()} "
                       "elements", f"{inp.numel()} ({describe(input)})")
        mpi_type, wire, mpi_op = reduction(call, inp.dtype, op)
        if self.check:
            agree(self.mpi_comm, call, f"op={op}, output={_sig(out)}, input={_sig(inp)}")
        mpi_call = "ireduce_scatter_block" if async_op else "reduce_scatter_block"
        if host_overlap(out, inp):
            inp = inp.clone()
        plan = reduce16.plan_op(op, self.size, factor) if inp.dtype in reduce16.DTYPES else None
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

    # -- data movement ----------------------------------------------------------------------

    def broadcast(self, tensor, src: int = 0, async_op: bool = False) -> Work | None:
        """Copy ``tensor`` from rank ``src`` into ``tensor`` on every rank."""
        if not async_op and not self.check and fastpath.run(self, "broadcast", tensor, root=src):
            return None
        return self._broadcast(tensor, src, async_op)

    @observed_as("broadcast")
    def _broadcast(self, tensor, src, async_op):
        call = "broadcast"
        src = check_rank(call, "src", src, self.size)
        t = to_tensor(tensor, call, "tensor", writable=self.rank != src)
        mpi_type = move_type(call, "tensor", t)
        if self.check:
            agree(self.mpi_comm, call, f"src={src}, tensor={_sig(t)}")
        slot = prepare(t, IN if self.rank == src else OUT, mpi_type, t.dtype, self.device_policy,
                       "ibcast" if async_op else "bcast")
        return self._launch(self.mpi_comm.Bcast, self.mpi_comm.Ibcast,
                            (_spec(slot, t.numel()), src), [slot], async_op, [tensor])

    def all_gather_into_tensor(self, output_tensor, input_tensor,
                               async_op: bool = False) -> Work | None:
        """Concatenate every rank's ``input_tensor`` (in rank order) into ``output_tensor``."""
        if (not async_op and not self.check
                and fastpath.run(self, "all_gather_into_tensor", output_tensor, input_tensor)):
            return None
        return self._all_gather_into_tensor(output_tensor, input_tensor, async_op)

    @observed_as("all_gather_into_tensor")
    def _all_gather_into_tensor(self, output_tensor, input_tensor, async_op):
        call = "all_gather_into_tensor"
        out = to_tensor(output_tensor, call, "output_tensor", writable=True)
        inp = to_tensor(input_tensor, call, "input_tensor", writable=False)
        same_dtype(call, "output_tensor", out, inp)
        same_device(call, "output_tensor", out, inp)
        if out.numel() != self.size * inp.numel():
            fail_value(call, "output_tensor", f"{self.size} x input_tensor.numel() = "
                       f"{self.size * inp.numel()} elements", f"{out.numel()} ({describe(output_tensor)})")
        mpi_type = move_type(call, "input_tensor", inp)
        if self.check:
            agree(self.mpi_comm, call, f"output={_sig(out)}, input={_sig(inp)}")
        mpi_call = "iallgather" if async_op else "allgather"
        recv = prepare(out, OUT, mpi_type, out.dtype, self.device_policy, mpi_call)
        slots = [recv]
        if (host_overlap(out, inp) and recv.work is out and inp.is_contiguous()
                and inp.data_ptr() == out.data_ptr() + self.rank * inp.numel() * inp.element_size()):
            send_spec = MPI.IN_PLACE  # the input already sits in this rank's slot
        else:
            send = prepare(inp.clone() if host_overlap(out, inp) else inp, IN, mpi_type, inp.dtype,
                           self.device_policy, mpi_call)
            slots.append(send)
            send_spec = _spec(send, inp.numel())
        return self._launch(self.mpi_comm.Allgather, self.mpi_comm.Iallgather,
                            (send_spec, _spec(recv, inp.numel())), slots, async_op,
                            [output_tensor])

    @observed
    def all_gather(self, tensor_list: list, tensor, async_op: bool = False) -> Work | None:
        """Gather every rank's ``tensor`` into ``tensor_list[r]`` on every rank."""
        call = "all_gather"
        inp = to_tensor(tensor, call, "tensor", writable=False)
        outs = per_rank_list(call, "tensor_list", tensor_list, inp, self.size)
        flat = torch.empty((self.size * inp.numel(),), dtype=inp.dtype, device=inp.device)
        if self.check:
            agree(self.mpi_comm, call, f"tensor={_sig(inp)}")
        mpi_call = "iallgather" if async_op else "allgather"
        mpi_type = move_type(call, "tensor", inp)
        send = prepare(inp, IN, mpi_type, inp.dtype, self.device_policy, mpi_call)
        recv = prepare(flat, OUT, mpi_type, inp.dtype, self.device_policy, mpi_call)
        return self._launch(self.mpi_comm.Allgather, self.mpi_comm.Iallgather,
                            (_spec(send, inp.numel()), _spec(recv, inp.numel())), [send, recv],
                            async_op, tensor_list, extra=[lambda: _unflatten_into(flat, outs)])

    def all_to_all_single(self, output, input, output_split_sizes: list[int] | None = None,
                          input_split_sizes: list[int] | None = None,
                          async_op: bool = False) -> Work | None:
        """Rank r sends its j-th chunk of ``input`` (along dim 0) to rank j, which stores it as chunk r of ``output``."""
        if (not async_op and not self.check and output_split_sizes is None
                and input_split_sizes is None
                and fastpath.run(self, "all_to_all_single", output, input)):
            return None
        return self._all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op)

    @observed_as("all_to_all_single")
    def _all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, async_op):
        call = "all_to_all_single"
        out = to_tensor(output, call, "output", writable=True)
        inp = to_tensor(input, call, "input", writable=False)
        same_dtype(call, "output", out, inp)
        same_device(call, "output", out, inp)
        mpi_type = move_type(call, "input", inp)
        mpi_call = "ialltoallv" if async_op else "alltoallv"
        if output_split_sizes is None and input_split_sizes is None:
            if out.numel() != inp.numel() or inp.numel() % self.size:
                fail_value(call, "output", f"output.numel() == input.numel(), divisible by "
                           f"{self.size} ranks", f"output {describe(output)}, input {describe(input)}")
            counts = None
            mpi_call = "ialltoall" if async_op else "alltoall"
        else:
            send_counts, send_displs = splits(call, "input_split_sizes", input_split_sizes, inp,
                                              self.size)
            recv_counts, recv_displs = splits(call, "output_split_sizes", output_split_sizes, out,
                                              self.size)
            counts = (send_counts, send_displs, recv_counts, recv_displs)
        if self.check:
            agree(self.mpi_comm, call, f"dtype={inp.dtype}" if counts else
                  f"output={_sig(out)}, input={_sig(inp)}")
        if host_overlap(out, inp):
            inp = inp.clone()
        send = prepare(inp, IN, mpi_type, inp.dtype, self.device_policy, mpi_call)
        recv = prepare(out, OUT, mpi_type, out.dtype, self.device_policy, mpi_call)
        comm = self.mpi_comm
        if counts is None:
            per_rank = inp.numel() // self.size
            args = (_spec(send, per_rank), _spec(recv, per_rank))
            return self._launch(comm.Alltoall, comm.Ialltoall, args, [send, recv], async_op,
                                [output])
        if large.too_big(*(c for part in counts for c in part)):
            args = large.alltoallw_specs(send.spec, recv.spec, counts)
            return self._launch(comm.Alltoallw, comm.Ialltoallw, args, [send, recv], async_op,
                                [output])
        sc, sd, rc, rd = counts
        args = ([send.spec[0], (sc, sd), mpi_type], [recv.spec[0], (rc, rd), mpi_type])
        return self._launch(comm.Alltoallv, comm.Ialltoallv, args, [send, recv], async_op,
                            [output])

    @observed
    def gather(self, tensor, gather_list: list | None = None, dst: int = 0,
               async_op: bool = False) -> Work | None:
        """Collect every rank's ``tensor`` into ``gather_list`` on rank ``dst``."""
        call = "gather"
        dst = check_rank(call, "dst", dst, self.size)
        inp = to_tensor(tensor, call, "tensor", writable=False)
        mpi_type = move_type(call, "tensor", inp)
        root = self.rank == dst
        outs = root_list(call, "gather_list", gather_list, inp, "dst", dst, self.rank, self.size)
        if self.check:
            agree(self.mpi_comm, call, f"dst={dst}, tensor={_sig(inp)}")
        mpi_call = "igather" if async_op else "gather"
        send = prepare(inp, IN, mpi_type, inp.dtype, self.device_policy, mpi_call)
        n = inp.numel()
        if not root:
            return self._launch(self.mpi_comm.Gather, self.mpi_comm.Igather,
                                (_spec(send, n), None, dst), [send], async_op, [])
        flat = torch.empty((self.size * n,), dtype=inp.dtype, device=inp.device)
        recv = prepare(flat, OUT, mpi_type, inp.dtype, self.device_policy, mpi_call)
        return self._launch(self.mpi_comm.Gather, self.mpi_comm.Igather,
                            (_spec(send, n), _spec(recv, n), dst), [send, recv], async_op,
                            gather_list, extra=[lambda: _unflatten_into(flat, outs)])

    @observed
    def scatter(self, tensor, scatter_list: list | None = None, src: int = 0,
                async_op: bool = False) -> Work | None:
        """Rank ``src`` sends ``scatter_list[r]`` into ``tensor`` on rank r."""
        call = "scatter"
        src = check_rank(call, "src", src, self.size)
        out = to_tensor(tensor, call, "tensor", writable=True)
        mpi_type = move_type(call, "tensor", out)
        root = self.rank == src
        ins = root_list(call, "scatter_list", scatter_list, out, "src", src, self.rank, self.size)
        if self.check:
            agree(self.mpi_comm, call, f"src={src}, tensor={_sig(out)}")
        mpi_call = "iscatter" if async_op else "scatter"
        recv = prepare(out, OUT, mpi_type, out.dtype, self.device_policy, mpi_call)
        n = out.numel()
        if not root:
            return self._launch(self.mpi_comm.Scatter, self.mpi_comm.Iscatter,
                                (None, _spec(recv, n), src), [recv], async_op, [tensor])
        flat = torch.cat([x.reshape(-1) for x in ins])
        send = prepare(flat, IN, mpi_type, out.dtype, self.device_policy, mpi_call)
        return self._launch(self.mpi_comm.Scatter, self.mpi_comm.Iscatter,
                            (_spec(send, n), _spec(recv, n), src), [send, recv], async_op, [tensor])

    # -- synchronisation and groups ---------------------------------------------------------

    @observed
    def barrier(self, async_op: bool = False) -> Work | None:
        """Wait until every rank has entered the barrier."""
        return self._launch(self.mpi_comm.Barrier, self.mpi_comm.Ibarrier, (), [], async_op, [])

    def split(self, color: int | None, key: int = 0) -> "Communicator | None":
        """Sub-communicator of the ranks passing the same ``color`` (None: not a member), ordered by ``key``."""
        if color is not None and (not isinstance(color, int) or color < 0):
            fail_value("split", "color", "a non-negative int or None", repr(color))
        sub = self.mpi_comm.Split(MPI.UNDEFINED if color is None else color, key)
        if sub == MPI.COMM_NULL:
            return None
        return Communicator(sub, check=self.check)

    def split_node(self) -> "Communicator":
        """Sub-communicator of this communicator's ranks on this rank's node (shared memory,
        ``MPI_COMM_TYPE_SHARED``), in this communicator's rank order. Collective."""
        return Communicator(self.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, self.rank), check=self.check)

    def dup(self) -> "Communicator":
        """A communicator over the same ranks with its own message space."""
        return Communicator(self.mpi_comm.Dup(), check=self.check)

    def free(self) -> None:
        """Release the MPI communicator (not for the world communicator)."""
        if self._r16 is not None:
            self._r16.free()
        if self.mpi_comm not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self.mpi_comm.Free()


def _spec(slot: Slot, per_rank: int) -> list:
    """The slot's MPI spec; one derived element per rank when ``per_rank`` is too big for MPI."""
    return large.move_spec(slot.spec, per_rank) if large.too_big(per_rank) else slot.spec


def _unflatten_into(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    for piece, out in zip(flat.chunk(len(outs)), outs):
        out.copy_(piece.view(out.shape))


def init(check: bool | None = None) -> Communicator:
    """Return the world communicator, creating it on first use (idempotent)."""
    global _world
    if _world is None:
        _world = Communicator(MPI.COMM_WORLD, check=check)
        log_init(_world)
    elif check is not None:
        _world.check = bool(check)
    return _world


def as_communicator(comm: "Communicator | MPI.Comm | None" = None) -> Communicator:
    """The Communicator for ``comm``: None is the world; an mpi4py intracommunicator is wrapped.

    Wrapping an mpi4py communicator other than ``MPI.COMM_WORLD`` is collective over it (the
    Communicator learns its node-local ranks); ``MPI.COMM_WORLD`` maps to :func:`init`'s world.
    """
    if comm is None:
        return init()
    if isinstance(comm, Communicator):
        return comm
    if isinstance(comm, MPI.Intracomm) and comm != MPI.COMM_NULL:
        if comm == MPI.COMM_WORLD:
            return init()
        return Communicator(comm)
    raise TypeError(f"comm: expected None (the world), an mpicomm.Communicator or an mpi4py "
                    f"intracommunicator, got {type(comm).__name__}")


def get_world() -> Communicator:
    """The world communicator created by init()."""
    if _world is None:
        raise RuntimeError("mpicomm: call mpicomm.init() before using the module-level collectives")
    return _world


def is_initialized() -> bool:
    """Whether init() has created the world communicator."""
    return _world is not None
