"""The Communicator: torch.distributed-style collectives on one MPI communicator.

Every collective follows the same path: validate the arguments (errors raised before any MPI
call), optionally agree across ranks (checking mode), adapt each buffer for MPI (zero-copy when
possible; otherwise contiguous, upcast or staged copies), call MPI's blocking or non-blocking
primitive, and put results back into the caller's buffers when the call completes.
"""
from __future__ import annotations

import os
import warnings
from typing import Callable, Sequence

import torch
from mpi4py import MPI

from . import dtypes, fastpath
from .buffers import IN, INOUT, OUT, Slot, host_overlap, prepare, to_tensor
from .checking import agree
from .device_paths import DevicePolicy
from .errors import check_rank, check_type, describe, fail_value
from .ops import MPI_BOOL_OPS, MPI_OPS, ReduceOp, parse_op
from .work import Work

_world: "Communicator | None" = None


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}: expected 0 or 1, got {value!r}")


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


class Communicator:
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
        self.check: bool = _env_flag("MPICOMM_CHECK") if check is None else bool(check)
        self._policy: DevicePolicy | None = None
        self._tag_ub: int = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)

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

    def _reduction(self, call: str, dtype: torch.dtype, op: ReduceOp):
        """(MPI datatype, wire dtype, MPI op) for reducing ``dtype`` with ``op``."""
        if dtype == torch.bool:
            if op is ReduceOp.AVG:
                fail_value(call, "op", "SUM, MAX, MIN or PROD for a bool buffer", str(op))
            return MPI.C_BOOL, dtype, MPI_BOOL_OPS[op]
        wire = dtypes.UPCAST.get(dtype, dtype)
        mpi_type = dtypes.NATIVE.get(wire)
        if mpi_type is None:
            raise TypeError(f'{call} got unexpected dtype for argument "tensor" (expected: one of '
                            f"{dtypes.supported_names()}, got: {dtype})")
        if op is ReduceOp.AVG and dtype not in dtypes.FLOATING:
            fail_value(call, "op", "SUM, MAX, MIN or PROD for an integer buffer "
                       "(AVG needs a floating dtype)", f"{op} on {dtype}")
        return mpi_type, wire, MPI_OPS[op]

    def _move_type(self, call: str, arg: str, t: torch.Tensor):
        mpi_type = dtypes.move_type(t.dtype)
        if mpi_type is None:
            raise TypeError(f'{call} got unexpected dtype for argument "{arg}" (expected: one of '
                            f"{dtypes.supported_names()}, got: {t.dtype})")
        return mpi_type

    def _same_dtype(self, call: str, arg: str, t: torch.Tensor, ref: torch.Tensor) -> None:
        if t.dtype != ref.dtype:
            fail_value(call, arg, f"dtype {ref.dtype} (the dtype of the input)", str(t.dtype))

    def _same_device(self, call: str, arg: str, t: torch.Tensor, ref: torch.Tensor) -> None:
        if t.device != ref.device:
            fail_value(call, arg, f"a buffer on {ref.device} (where the input is)", str(t.device))

    # -- reductions -------------------------------------------------------------------------

    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` across ranks, in place."""
        if not async_op and not self.check and fastpath.run(self, "all_reduce", tensor, op=op):
            return None
        call = "all_reduce"
        op = parse_op(op, call)
        t = to_tensor(tensor, call, "tensor", writable=True)
        mpi_type, wire, mpi_op = self._reduction(call, t.dtype, op)
        if self.check:
            agree(self.mpi_comm, call, f"op={op}, tensor={_sig(t)}")
        slot = prepare(t, INOUT, mpi_type, wire, self.device_policy,
                       "iallreduce" if async_op else "allreduce")
        if op is ReduceOp.AVG:
            slot.scale = self.size
        return self._launch(self.mpi_comm.Allreduce, self.mpi_comm.Iallreduce,
                            (MPI.IN_PLACE, slot.spec, mpi_op), [slot], async_op, [tensor])

    def reduce(self, tensor, dst: int = 0, op=ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` across ranks into ``tensor`` on rank ``dst`` (others keep theirs)."""
        call = "reduce"
        op = parse_op(op, call)
        dst = check_rank(call, "dst", dst, self.size)
        t = to_tensor(tensor, call, "tensor", writable=True)
        mpi_type, wire, mpi_op = self._reduction(call, t.dtype, op)
        if self.check:
            agree(self.mpi_comm, call, f"op={op}, dst={dst}, tensor={_sig(t)}")
        root = self.rank == dst
        slot = prepare(t, INOUT if root else IN, mpi_type, wire, self.device_policy,
                       "ireduce" if async_op else "reduce")
        if op is ReduceOp.AVG and root:
            slot.scale = self.size
        args = (MPI.IN_PLACE, slot.spec, mpi_op, dst) if root else (slot.spec, None, mpi_op, dst)
        return self._launch(self.mpi_comm.Reduce, self.mpi_comm.Ireduce, args, [slot], async_op,
                            [tensor])

    def reduce_scatter_tensor(self, output, input, op=ReduceOp.SUM,
                              async_op: bool = False) -> Work | None:
        """Reduce ``input`` across ranks; rank r receives the r-th of ``size`` equal chunks in ``output``."""
        if (not async_op and not self.check
                and fastpath.run(self, "reduce_scatter_tensor", output, input, op=op)):
            return None
        call = "reduce_scatter_tensor"
        op = parse_op(op, call)
        out = to_tensor(output, call, "output", writable=True)
        inp = to_tensor(input, call, "input", writable=False)
        self._same_dtype(call, "output", out, inp)
        self._same_device(call, "output", out, inp)
        if inp.numel() != self.size * out.numel():
            fail_value(call, "input", f"{self.size} x output.numel() = {self.size * out.numel()} "
                       "elements", f"{inp.numel()} ({describe(input)})")
        mpi_type, wire, mpi_op = self._reduction(call, inp.dtype, op)
        if self.check:
            agree(self.mpi_comm, call, f"op={op}, output={_sig(out)}, input={_sig(inp)}")
        mpi_call = "ireduce_scatter_block" if async_op else "reduce_scatter_block"
        if host_overlap(out, inp):
            inp = inp.clone()
        send = prepare(inp, IN, mpi_type, wire, self.device_policy, mpi_call)
        recv = prepare(out, OUT, mpi_type, wire, self.device_policy, mpi_call)
        if op is ReduceOp.AVG:
            recv.scale = self.size
        return self._launch(self.mpi_comm.Reduce_scatter_block, self.mpi_comm.Ireduce_scatter_block,
                            (send.spec, recv.spec, mpi_op), [send, recv], async_op, [output])

    # -- data movement ----------------------------------------------------------------------

    def broadcast(self, tensor, src: int = 0, async_op: bool = False) -> Work | None:
        """Copy ``tensor`` from rank ``src`` into ``tensor`` on every rank."""
        if not async_op and not self.check and fastpath.run(self, "broadcast", tensor, root=src):
            return None
        call = "broadcast"
        src = check_rank(call, "src", src, self.size)
        t = to_tensor(tensor, call, "tensor", writable=self.rank != src)
        mpi_type = self._move_type(call, "tensor", t)
        if self.check:
            agree(self.mpi_comm, call, f"src={src}, tensor={_sig(t)}")
        slot = prepare(t, IN if self.rank == src else OUT, mpi_type, t.dtype, self.device_policy,
                       "ibcast" if async_op else "bcast")
        return self._launch(self.mpi_comm.Bcast, self.mpi_comm.Ibcast, (slot.spec, src), [slot],
                            async_op, [tensor])

    def all_gather_into_tensor(self, output_tensor, input_tensor,
                               async_op: bool = False) -> Work | None:
        """Concatenate every rank's ``input_tensor`` (in rank order) into ``output_tensor``."""
        if (not async_op and not self.check
                and fastpath.run(self, "all_gather_into_tensor", output_tensor, input_tensor)):
            return None
        call = "all_gather_into_tensor"
        out = to_tensor(output_tensor, call, "output_tensor", writable=True)
        inp = to_tensor(input_tensor, call, "input_tensor", writable=False)
        self._same_dtype(call, "output_tensor", out, inp)
        self._same_device(call, "output_tensor", out, inp)
        if out.numel() != self.size * inp.numel():
            fail_value(call, "output_tensor", f"{self.size} x input_tensor.numel() = "
                       f"{self.size * inp.numel()} elements", f"{out.numel()} ({describe(output_tensor)})")
        mpi_type = self._move_type(call, "input_tensor", inp)
        if self.check:
            agree(self.mpi_comm, call, f"output={_sig(out)}, input={_sig(inp)}")
        mpi_call = "iallgather" if async_op else "allgather"
        recv = prepare(out, OUT, mpi_type, out.dtype, self.device_policy, mpi_call)
        slots = [recv]
        if host_overlap(out, inp):
            if (recv.work is out and inp.is_contiguous()
                    and inp.data_ptr() == out.data_ptr() + self.rank * inp.numel() * inp.element_size()):
                send_spec = MPI.IN_PLACE  # the input already sits in this rank's slot
            else:
                send = prepare(inp.clone(), IN, mpi_type, inp.dtype, self.device_policy, mpi_call)
                slots.append(send)
                send_spec = send.spec
        else:
            send = prepare(inp, IN, mpi_type, inp.dtype, self.device_policy, mpi_call)
            slots.append(send)
            send_spec = send.spec
        return self._launch(self.mpi_comm.Allgather, self.mpi_comm.Iallgather,
                            (send_spec, recv.spec), slots, async_op, [output_tensor])

    def all_gather(self, tensor_list: list, tensor, async_op: bool = False) -> Work | None:
        """Gather every rank's ``tensor`` into ``tensor_list[r]`` on every rank."""
        call = "all_gather"
        inp = to_tensor(tensor, call, "tensor", writable=False)
        outs = self._check_list(call, "tensor_list", tensor_list, inp)
        flat = torch.empty((self.size * inp.numel(),), dtype=inp.dtype, device=inp.device)
        if self.check:
            agree(self.mpi_comm, call, f"tensor={_sig(inp)}")
        mpi_call = "iallgather" if async_op else "allgather"
        mpi_type = self._move_type(call, "tensor", inp)
        send = prepare(inp, IN, mpi_type, inp.dtype, self.device_policy, mpi_call)
        recv = prepare(flat, OUT, mpi_type, inp.dtype, self.device_policy, mpi_call)
        return self._launch(self.mpi_comm.Allgather, self.mpi_comm.Iallgather,
                            (send.spec, recv.spec), [send, recv], async_op, tensor_list,
                            extra=[lambda: _unflatten_into(flat, outs)])

    def all_to_all_single(self, output, input, output_split_sizes: list[int] | None = None,
                          input_split_sizes: list[int] | None = None,
                          async_op: bool = False) -> Work | None:
        """Rank r sends its j-th chunk of ``input`` (along dim 0) to rank j, which stores it as chunk r of ``output``."""
        if (not async_op and not self.check and output_split_sizes is None
                and input_split_sizes is None
                and fastpath.run(self, "all_to_all_single", output, input)):
            return None
        call = "all_to_all_single"
        out = to_tensor(output, call, "output", writable=True)
        inp = to_tensor(input, call, "input", writable=False)
        self._same_dtype(call, "output", out, inp)
        self._same_device(call, "output", out, inp)
        mpi_type = self._move_type(call, "input", inp)
        mpi_call = "ialltoallv" if async_op else "alltoallv"
        if output_split_sizes is None and input_split_sizes is None:
            if out.numel() != inp.numel() or inp.numel() % self.size:
                fail_value(call, "output", f"output.numel() == input.numel(), divisible by "
                           f"{self.size} ranks", f"output {describe(output)}, input {describe(input)}")
            counts = None
            mpi_call = "ialltoall" if async_op else "alltoall"
        else:
            send_counts, send_displs = self._splits(call, "input_split_sizes", input_split_sizes, inp)
            recv_counts, recv_displs = self._splits(call, "output_split_sizes", output_split_sizes, out)
            counts = (send_counts, send_displs, recv_counts, recv_displs)
        if self.check:
            agree(self.mpi_comm, call, f"dtype={inp.dtype}" if counts else
                  f"output={_sig(out)}, input={_sig(inp)}")
        if host_overlap(out, inp):
            inp = inp.clone()
        send = prepare(inp, IN, mpi_type, inp.dtype, self.device_policy, mpi_call)
        recv = prepare(out, OUT, mpi_type, out.dtype, self.device_policy, mpi_call)
        if counts is None:
            args = (send.spec, recv.spec)
            return self._launch(self.mpi_comm.Alltoall, self.mpi_comm.Ialltoall, args,
                                [send, recv], async_op, [output])
        sc, sd, rc, rd = counts
        args = ([send.spec[0], (sc, sd), mpi_type], [recv.spec[0], (rc, rd), mpi_type])
        return self._launch(self.mpi_comm.Alltoallv, self.mpi_comm.Ialltoallv, args,
                            [send, recv], async_op, [output])

    def _splits(self, call: str, arg: str, splits, t: torch.Tensor):
        """Element counts and displacements for split sizes along dim 0 (None: equal splits)."""
        rows = t.shape[0] if t.dim() else 1
        row = t.numel() // rows if rows else 0
        if splits is None:
            if rows % self.size:
                fail_value(call, arg, f"split sizes (dim 0 of size {rows} is not divisible by "
                           f"{self.size} ranks)", "None")
            splits = [rows // self.size] * self.size
        splits = [int(s) for s in splits]
        if len(splits) != self.size or any(s < 0 for s in splits) or sum(splits) != rows:
            fail_value(call, arg, f"{self.size} non-negative sizes summing to dim 0 = {rows}",
                       str(splits))
        counts = [s * row for s in splits]
        displs = [0] * self.size
        for i in range(1, self.size):
            displs[i] = displs[i - 1] + counts[i - 1]
        return counts, displs

    def gather(self, tensor, gather_list: list | None = None, dst: int = 0,
               async_op: bool = False) -> Work | None:
        """Collect every rank's ``tensor`` into ``gather_list`` on rank ``dst``."""
        call = "gather"
        dst = check_rank(call, "dst", dst, self.size)
        inp = to_tensor(tensor, call, "tensor", writable=False)
        mpi_type = self._move_type(call, "tensor", inp)
        root = self.rank == dst
        outs = self._root_list(call, "gather_list", gather_list, inp, "dst", dst)
        if self.check:
            agree(self.mpi_comm, call, f"dst={dst}, tensor={_sig(inp)}")
        mpi_call = "igather" if async_op else "gather"
        send = prepare(inp, IN, mpi_type, inp.dtype, self.device_policy, mpi_call)
        if not root:
            return self._launch(self.mpi_comm.Gather, self.mpi_comm.Igather,
                                (send.spec, None, dst), [send], async_op, [])
        flat = torch.empty((self.size * inp.numel(),), dtype=inp.dtype, device=inp.device)
        recv = prepare(flat, OUT, mpi_type, inp.dtype, self.device_policy, mpi_call)
        return self._launch(self.mpi_comm.Gather, self.mpi_comm.Igather,
                            (send.spec, recv.spec, dst), [send, recv], async_op, gather_list,
                            extra=[lambda: _unflatten_into(flat, outs)])

    def scatter(self, tensor, scatter_list: list | None = None, src: int = 0,
                async_op: bool = False) -> Work | None:
        """Rank ``src`` sends ``scatter_list[r]`` into ``tensor`` on rank r."""
        call = "scatter"
        src = check_rank(call, "src", src, self.size)
        out = to_tensor(tensor, call, "tensor", writable=True)
        mpi_type = self._move_type(call, "tensor", out)
        root = self.rank == src
        ins = self._root_list(call, "scatter_list", scatter_list, out, "src", src)
        if self.check:
            agree(self.mpi_comm, call, f"src={src}, tensor={_sig(out)}")
        mpi_call = "iscatter" if async_op else "scatter"
        recv = prepare(out, OUT, mpi_type, out.dtype, self.device_policy, mpi_call)
        if not root:
            return self._launch(self.mpi_comm.Scatter, self.mpi_comm.Iscatter,
                                (None, recv.spec, src), [recv], async_op, [tensor])
        flat = torch.cat([x.reshape(-1) for x in ins])
        send = prepare(flat, IN, mpi_type, out.dtype, self.device_policy, mpi_call)
        return self._launch(self.mpi_comm.Scatter, self.mpi_comm.Iscatter,
                            (send.spec, recv.spec, src), [send, recv], async_op, [tensor])

    def _root_list(self, call: str, arg: str, items, ref: torch.Tensor, root_arg: str,
                   root: int) -> list[torch.Tensor] | None:
        """Validate the per-rank list that only the root rank passes (None elsewhere)."""
        if self.rank == root:
            return self._check_list(call, arg, items, ref)
        if items:
            fail_value(call, arg, f"None or [] on rank {self.rank} (only {root_arg}={root} uses it)",
                       f"a list of {len(items)}")
        return None

    def _check_list(self, call: str, arg: str, items, ref: torch.Tensor) -> list[torch.Tensor]:
        if not isinstance(items, (list, tuple)) or len(items) != self.size:
            fail_value(call, arg, f"a list of {self.size} buffers (one per rank)",
                       f"{type(items).__name__} of length {len(items)}" if isinstance(items, (list, tuple))
                       else describe(items))
        out = []
        for i, item in enumerate(items):
            t = to_tensor(item, call, f"{arg}[{i}]", writable=True)
            if t.numel() != ref.numel() or t.dtype != ref.dtype:
                fail_value(call, f"{arg}[{i}]", f"{ref.numel()} elements of {ref.dtype}", describe(item))
            out.append(t)
        return out

    # -- point to point ---------------------------------------------------------------------

    def send(self, tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``dst`` (blocking)."""
        self._p2p("send", tensor, dst, tag, async_op=False)

    def recv(self, tensor, src: int | None = None, tag: int = 0) -> int:
        """Receive into ``tensor`` from rank ``src`` (None: any rank); return the sender's rank."""
        return self._p2p("recv", tensor, src, tag, async_op=False)

    def isend(self, tensor, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to rank ``dst``."""
        return self._p2p("isend", tensor, dst, tag, async_op=True)

    def irecv(self, tensor, src: int | None = None, tag: int = 0) -> Work:
        """Start receiving into ``tensor`` from rank ``src`` (None: any rank)."""
        return self._p2p("irecv", tensor, src, tag, async_op=True)

    def _p2p(self, call: str, tensor, peer, tag: int, async_op: bool):
        sending = call.endswith("send")
        if peer is None and not sending:
            peer = MPI.ANY_SOURCE
        else:
            peer = check_rank(call, "dst" if sending else "src", peer, self.size)
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= self._tag_ub:
            fail_value(call, "tag", f"an int in [0, {self._tag_ub}]", repr(tag))
        t = to_tensor(tensor, call, "tensor", writable=not sending)
        mpi_type = self._move_type(call, "tensor", t)
        slot = prepare(t, IN if sending else OUT, mpi_type, t.dtype, self.device_policy, call)
        if sending:
            return self._launch(self.mpi_comm.Send, self.mpi_comm.Isend, (slot.spec, peer, tag),
                                [slot], async_op, [tensor])
        if async_op:
            return self._launch(self.mpi_comm.Recv, self.mpi_comm.Irecv, (slot.spec, peer, tag),
                                [slot], True, [tensor])
        status = MPI.Status()
        self._launch(self.mpi_comm.Recv, self.mpi_comm.Irecv, (slot.spec, peer, tag, status),
                     [slot], False, [tensor])
        return status.Get_source()

    # -- synchronisation and groups ---------------------------------------------------------

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

    def dup(self) -> "Communicator":
        """A communicator over the same ranks with its own message space."""
        return Communicator(self.mpi_comm.Dup(), check=self.check)

    def free(self) -> None:
        """Release the MPI communicator (not for the world communicator)."""
        if self.mpi_comm not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self.mpi_comm.Free()


def _unflatten_into(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    for piece, out in zip(flat.chunk(len(outs)), outs):
        out.copy_(piece.view(out.shape))


def init(check: bool | None = None) -> Communicator:
    """Return the world communicator, creating it on first use (idempotent)."""
    global _world
    if _world is None:
        _world = Communicator(MPI.COMM_WORLD, check=check)
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
