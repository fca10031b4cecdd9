"""MpicommProcessGroup: torch.distributed's ProcessGroup interface on an mpicomm Communicator."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

import time

from .. import progress_thread
from ..communicator import Communicator
from ._ops import to_mpicomm
from . import _deadlines
from ._work import MpicommWork, expire

BACKEND_NAME = "mpicomm"
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


class MpicommProcessGroup(dist.ProcessGroup):
    """A process group whose calls run as non-blocking MPI operations through mpicomm.

    ``async_op=True`` returns at once (mpicomm's progress thread completes the work); blocking
    calls run MPI's blocking primitive, their deadline kept by the deadline thread. Past ``timeout`` a work fails with
    ``ProcessGroupTimeoutError`` and the job is aborted. ``store`` (the process group's store)
    carries the ranks' progress reports for timeout messages.
    """

    def __init__(self, comm: Communicator, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                 store: dist.Store | None = None) -> None:
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self.timeout = timeout
        self._store = store
        self._seq = 0
        self._broken: str | None = None
        self._group_name = ""
        self._group_desc = ""

    # -- identity (torch reads these through its C++ ProcessGroup) --------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's names
        return BACKEND_NAME

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def shutdown(self) -> None:
        """Release the group's MPI communicator (dist.destroy_process_group calls this)."""
        if self._broken is None and self.comm is not None:
            self.comm.free()
        self.comm = None

    # -- plumbing ---------------------------------------------------------------------------

    def _run(self, call: str, opts, start, result: list, described, finish=(), source=None):
        """Run ``start(async_op)`` (-> mpicomm Works, or Nones when blocking) as one work.

        A blocking call (``opts.asyncOp`` false) runs MPI's blocking primitives on this thread
        (the deadline thread keeps its deadline); otherwise the work goes to the progress
        thread. Below
        MPI_THREAD_MULTIPLE both test the non-blocking requests on this thread until done.
        """
        if self._broken is not None:
            raise RuntimeError(f"mpicomm process group: {call} refused, the group is unusable "
                               f"after an earlier timeout: {self._broken}")
        if self.comm is None:
            raise RuntimeError(f"mpicomm process group: {call} on a group that was destroyed")
        self._seq += 1
        timeout = self.timeout
        t = getattr(opts, "timeout", None)
        if isinstance(t, datetime.timedelta) and t.total_seconds() > 0:
            timeout = t
        if progress_thread.enabled() and not getattr(opts, "asyncOp", True):
            # MPI's blocking call on this thread (as fast as mpicomm's), deadline watched
            seq, began, limit = self._seq, time.monotonic(), timeout.total_seconds()
            key = _deadlines.watch(_deadlines.Deadline(
                began + limit, lambda: expire(self, call, seq, described, timeout,
                                              time.monotonic() - began, abort_now=True),
                notice=began + limit / 2, on_notice=lambda: self._publish_waiting(seq, call)))
            try:
                start(False)
            finally:
                watched = _deadlines.unwatch(key)
                if watched is not None and watched.noticed:
                    self._publish_waiting(None, None)
            for step in finish:
                step()
            return MpicommWork(self, call, self._seq, [], (), result, described, timeout)
        inner = [w for w in start(True) if w is not None]
        work = MpicommWork(self, call, self._seq, inner, finish, result, described, timeout,
                           source=source)
        if getattr(opts, "asyncOp", True):
            if progress_thread.enabled():
                work._launch_threaded()
            else:  # no progress thread below MPI_THREAD_MULTIPLE: complete before returning
                work.wait()
        return work

    def _publish_waiting(self, seq, call) -> None:
        """Tell the other ranks (through the store) which call this rank is stuck in."""
        if self._store is None:
            return
        try:
            self._store.set(f"mpicomm_waiting/{self.rank()}", "" if seq is None else f"{seq} {call}")
        except Exception:  # noqa: BLE001 - a report is best effort
            pass

    def _peers_report(self, seq: int, call: str) -> str:
        """Which ranks did not arrive at operation ``seq``, as far as the store tells."""
        if self._store is None or self.size() == 1:
            return ""
        self._publish_waiting(seq, call)
        lines = []
        for peer in range(self.size()):
            if peer == self.rank():
                continue
            key = f"mpicomm_waiting/{peer}"
            try:
                state = self._store.get(key).decode() if self._store.check([key]) else ""
            except Exception:  # noqa: BLE001
                state = "?"
            if state == "?":
                lines.append(f"rank {peer}: unknown (the store did not answer)")
            elif not state:
                lines.append(f"rank {peer}: did not arrive (not waiting in any call of this group)")
            else:
                their_seq, their_call = state.split(" ", 1)
                if int(their_seq) < seq:
                    lines.append(f"rank {peer}: did not arrive (still in #{their_seq} {their_call})")
                elif int(their_seq) > seq:
                    lines.append(f"rank {peer}: skipped it (now in #{their_seq} {their_call})")
                elif their_call != call:
                    lines.append(f"rank {peer}: called {their_call} as #{their_seq} instead")
                else:
                    lines.append(f"rank {peer}: waiting in it too")
        return "Ranks: " + "; ".join(lines) + "."

    def _reduce_op(self, opts, call: str):
        return to_mpicomm(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, call)

    # -- collectives ------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        op, factor = self._reduce_op(opts, "allreduce")

        def start(a):
            return [self.comm.all_reduce(t, op=op, async_op=a, factor=factor) for t in tensors]
        return self._run("all_reduce", opts, start, tensors, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        return self._run("broadcast", opts, lambda a: [
            self.comm.broadcast(t, src=opts.rootRank, async_op=a) for t in tensors],
            tensors, tensors)

    def reduce(self, tensors, opts):
        op, factor = self._reduce_op(opts, "reduce")

        def start(a):
            return [self.comm.reduce(t, dst=opts.rootRank, op=op, async_op=a, factor=factor)
                    for t in tensors]
        return self._run("reduce", opts, start, tensors, tensors)

    def all_gather_single(self, output, input, opts=None):
        return self._run("all_gather_into_tensor", opts, lambda a: [
            self.comm.all_gather_into_tensor(output, input, async_op=a)], [output], [input])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._run("all_gather_into_tensor_coalesced", opts, lambda a: [
            self.comm.all_gather_into_tensor(o, i, async_op=a) for o, i in zip(outputs, inputs)],
            outputs, inputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_lists, inputs, opts=None):
        return self._run("all_gather", opts, lambda a: [
            self.comm.all_gather(outs, t, async_op=a) for outs, t in zip(output_lists, inputs)],
            output_lists, inputs)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def alltoall(self, outputs, inputs, opts=None):
        if not inputs:
            return self._run("all_to_all", opts, lambda a: [], outputs, inputs)
        out_flat = torch.empty(sum(o.numel() for o in outputs), dtype=outputs[0].dtype,
                               device=outputs[0].device)

        def unpack():
            for o, piece in zip(outputs, out_flat.split([o.numel() for o in outputs])):
                o.copy_(piece.view(o.shape))
        in_flat = torch.cat([i.reshape(-1) for i in inputs])
        return self._run("all_to_all", opts, lambda a: [self.comm.all_to_all_single(
            out_flat, in_flat, [o.numel() for o in outputs], [i.numel() for i in inputs],
            async_op=a)], outputs, inputs, finish=[unpack])

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._run("all_to_all_single", opts, lambda a: [self.comm.all_to_all_single(
            output, input, output_split_sizes or None, input_split_sizes or None, async_op=a)],
            [output], [input])

    alltoall_base = all_to_all_single

    def reduce_scatter_single(self, output, input, opts=None):
        return self.reduce_scatter_single_coalesced([output], [input], opts, "reduce_scatter_tensor")

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None,
                                        call="reduce_scatter_tensor_coalesced"):
        op, factor = self._reduce_op(opts, call)
        return self._run(call, opts, lambda a: [
            self.comm.reduce_scatter_tensor(o, i, op=op, async_op=a, factor=factor)
            for o, i in zip(outputs, inputs)], outputs, inputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        flat = [torch.cat([c.reshape(-1) for c in chunks]) for chunks in input_lists]
        return self.reduce_scatter_single_coalesced(outputs, flat, opts, "reduce_scatter")

    def gather(self, output_lists, inputs, opts):
        root = self.comm.rank == opts.rootRank
        return self._run("gather", opts, lambda a: [self.comm.gather(
            inputs[0], output_lists[0] if root else None, dst=opts.rootRank, async_op=a)],
            output_lists, inputs)

    def scatter(self, outputs, input_lists, opts):
        root = self.comm.rank == opts.rootRank
        return self._run("scatter", opts, lambda a: [self.comm.scatter(
            outputs[0], input_lists[0] if root else None, src=opts.rootRank, async_op=a)],
            outputs, outputs)

    def barrier(self, opts=None):
        return self._run("barrier", opts, lambda a: [self.comm.barrier(async_op=a)], [], [])

    # -- point to point ---------------------------------------------------------------------

    def send(self, tensors, dst, tag):
        return self._run("send", None, lambda a: [self.comm.isend(t, dst, tag) for t in tensors],
                         tensors, tensors)

    def recv(self, tensors, src, tag):
        works = []
        return self._run("recv", None, lambda a: works.extend(
            self.comm.irecv(t, src, tag) for t in tensors) or works, tensors, tensors,
            source=_Lazy(works))

    def recv_anysource(self, tensors, tag):
        return self.recv(tensors, None, tag)


class _Lazy:
    """The first receive of a call, known once the call has started."""

    def __init__(self, works: list) -> None:
        self._works = works

    def source_rank(self) -> int:
        return self._works[0].source_rank()
