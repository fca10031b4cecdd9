"""MpicommProcessGroup: torch.distributed's ProcessGroup interface on an mpicomm Communicator."""
from __future__ import annotations

import datetime
import time
from typing import Callable

import torch
import torch.distributed as dist

from .. import observe, progress_thread
from ..observe import _profiler
from ..communicator import Communicator
from ..ops import ReduceOp
from ._ops import op_name, to_mpicomm
from . import _monitored
from . import _work
from ._work import MpicommWork

BACKEND_NAME = "mpicomm"
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
_NO_TIME = datetime.timedelta(0)  # torch's options: a timeout not set


class MpicommProcessGroup(dist.ProcessGroup):
    """A process group whose calls run as non-blocking MPI operations through mpicomm.

    ``async_op=True`` returns at once (mpicomm's progress thread completes the work); a
    blocking call waits on the caller's thread. Past ``timeout`` a call fails in the caller with
    ``ProcessGroupTimeoutError`` and the group refuses further calls, as gloo's does.
    ``store`` (the process group's store) carries the ranks' progress reports for timeout
    messages.
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

    def abandon(self, why: str) -> None:
        """Refuse further calls (``why``: "after ..."), and keep the MPI communicator from being
        freed (it may hold failed ranks): what ``reinit_process_group`` does to the groups it
        drops. Local."""
        if self._broken is None:
            self._broken = why

    # -- plumbing ---------------------------------------------------------------------------

    def _run(self, call: str, opts, start: Callable[[], list], result: list, described,
             finish=(), source=None, blocking: bool | None = None) -> MpicommWork:
        """Run ``start()`` (-> mpicomm Works of non-blocking calls) as one process-group work.

        ``async_op=True`` (``opts.asyncOp``) hands the work to the progress thread and returns
        (the deadline thread keeps its deadline); a blocking call tests it on this thread until
        done: a short spin (``_work.SPIN_S``), then keeping the deadline itself. Past the timeout the work fails and the caller's
        ``wait()`` raises. Below MPI_THREAD_MULTIPLE every call completes before it returns.
        Under a profiler the call records one ``mpicomm:<call>`` event, and completes on the
        progress thread (an async event).
        """
        if self._broken is not None:
            raise RuntimeError(f"mpicomm process group: {call} refused, the group is unusable "
                               f"{self._broken}")
        if self.comm is None:
            raise RuntimeError(f"mpicomm process group: {call} on a group that was destroyed")
        self._seq += 1
        timeout = self.timeout
        t = getattr(opts, "timeout", None)
        if isinstance(t, datetime.timedelta) and t > _NO_TIME:
            timeout = t
        if blocking is None:
            blocking = not getattr(opts, "asyncOp", True)
        record = (observe.begin_event(f"{BACKEND_NAME}:{call}", described)
                  if _profiler._is_profiler_enabled else None)
        began = time.monotonic()
        if record is None:
            inner = [w for w in start() if w is not None]
            # A blocking call that completes within a short spin returns a completed work:
            # no deadline to set up (the timeout, counted from `began`, is far off).
            if blocking and _work.finished_by(
                    inner, began + min(_work.SPIN_S, timeout.total_seconds() / 2)):
                for w in inner:
                    if w._error is not None:
                        raise w._error
                for step in finish:
                    step()
                return MpicommWork.completed(self, call, self._seq, result, source)
        else:
            try:
                with observe.quiet():  # the communicator's own events stay out: one per call
                    inner = [w for w in start() if w is not None]
            except BaseException:
                record.end()
                raise
        work = MpicommWork(self, call, self._seq, inner, finish, result, described, timeout,
                           source=source, record=record, started=began)
        threaded = progress_thread.enabled() and (not blocking or record is not None)
        if threaded:
            work._launch_threaded()
        if blocking or not progress_thread.enabled():
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
        for t in tensors:
            if t.is_sparse:
                return self._sparse_allreduce(tensors, opts, op)

        def start():
            return [self.comm.all_reduce(t, op=op, async_op=True, factor=factor) for t in tensors]
        return self._run("all_reduce", opts, start, tensors, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def _sparse_allreduce(self, tensors, opts, op):
        """SUM of sparse COO tensors, as gloo's: every rank's indices and values gathered, then
        summed and coalesced, the result in the caller's tensor."""
        if op is not ReduceOp.SUM:
            raise ValueError(f"mpicomm process group: all_reduce of a sparse tensor supports "
                             f"ReduceOp.SUM only (as gloo), got {op_name(opts.reduceOp)}")
        if len(tensors) != 1 or not all(t.is_sparse for t in tensors):
            raise ValueError("mpicomm process group: all_reduce of sparse tensors takes one "
                             f"sparse COO tensor per call, got {len(tensors)} tensors of layouts "
                             f"{[str(t.layout) for t in tensors]}")
        tensor = tensors[0]
        local = tensor.coalesce()
        indices, values = local.indices(), local.values()
        nnz = torch.tensor([indices.shape[1]], dtype=torch.int64)
        counts = torch.empty(self.size(), dtype=torch.int64)
        self._run("all_reduce", opts, lambda: [self.comm.all_gather_into_tensor(
            counts, nnz, async_op=True)], [counts], tensors, blocking=True)
        most = int(counts.max())
        padded_i = indices.new_zeros((indices.shape[0], most))
        padded_i[:, :indices.shape[1]] = indices
        padded_v = values.new_zeros((most, *values.shape[1:]))
        padded_v[:values.shape[0]] = values
        all_i = indices.new_empty((self.size(), *padded_i.shape))
        all_v = values.new_empty((self.size(), *padded_v.shape))

        def assemble():
            got = [int(c) for c in counts]
            merged = torch.sparse_coo_tensor(
                torch.cat([all_i[r][:, :n] for r, n in enumerate(got)], dim=1),
                torch.cat([all_v[r][:n] for r, n in enumerate(got)]), tensor.shape,
                dtype=tensor.dtype, device=tensor.device).coalesce()
            tensor.copy_(merged)
        return self._run("all_reduce", opts, lambda: [
            self.comm.all_gather_into_tensor(all_i.view(-1), padded_i.reshape(-1), async_op=True),
            self.comm.all_gather_into_tensor(all_v.view(-1), padded_v.reshape(-1), async_op=True)],
            tensors, tensors, finish=[assemble])

    def broadcast(self, tensors, opts):
        return self._run("broadcast", opts, lambda: [
            self.comm.broadcast(t, src=opts.rootRank, async_op=True) for t in tensors],
            tensors, tensors)

    def reduce(self, tensors, opts):
        op, factor = self._reduce_op(opts, "reduce")

        def start():
            return [self.comm.reduce(t, dst=opts.rootRank, op=op, async_op=True, factor=factor)
                    for t in tensors]
        return self._run("reduce", opts, start, tensors, tensors)

    def all_gather_single(self, output, input, opts=None):
        return self._run("all_gather_into_tensor", opts, lambda: [
            self.comm.all_gather_into_tensor(output, input, async_op=True)], [output], [input])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._run("all_gather_into_tensor_coalesced", opts, lambda: [
            self.comm.all_gather_into_tensor(o, i, async_op=True)
            for o, i in zip(outputs, inputs)], outputs, inputs)

    # torch before 2.13 calls these under their former names (dist.all_gather_into_tensor
    # -> _allgather_base; 2.13's trampoline still falls back to the coalesced one)
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_lists, inputs, opts=None):
        """``output_lists[i][r]`` receives rank r's ``inputs[i]``."""
        return self._run("all_gather", opts, lambda: [
            self.comm.all_gather(outs, t, async_op=True) for outs, t in zip(output_lists, inputs)],
            output_lists, inputs)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """``output_lists[r][i]`` receives rank r's ``inputs[i]`` (torch's layout: one list per
        rank, unlike :meth:`allgather`): one all-gather of all inputs packed together."""
        size = self.size()
        if len(output_lists) != size or any(len(outs) != len(inputs) for outs in output_lists):
            raise ValueError(
                "mpicomm process group: all_gather_coalesced expects output_tensor_lists as one "
                f"list per rank ({size}), each with one tensor per input ({len(inputs)}); got "
                f"{[len(outs) for outs in output_lists]}")
        if not inputs:
            return self._run("all_gather_coalesced", opts, lambda: [], output_lists, inputs)
        dtype = inputs[0].dtype
        if any(t.dtype != dtype for t in inputs):
            raise ValueError("mpicomm process group: all_gather_coalesced expects inputs of one "
                             f"dtype, got {[str(t.dtype) for t in inputs]}")
        sizes = [t.numel() for t in inputs]
        packed = torch.cat([t.reshape(-1) for t in inputs]) if len(inputs) > 1 else \
            inputs[0].reshape(-1)
        gathered = packed.new_empty(size * packed.numel())

        def unpack():
            for r, piece in enumerate(gathered.view(size, -1)):
                for out, chunk in zip(output_lists[r], piece.split(sizes)):
                    out.copy_(chunk.view(out.shape))
        return self._run("all_gather_coalesced", opts, lambda: [
            self.comm.all_gather_into_tensor(gathered, packed, async_op=True)],
            output_lists, inputs, finish=[unpack])

    def alltoall(self, outputs, inputs, opts=None):
        if not inputs:
            return self._run("all_to_all", opts, lambda: [], outputs, inputs)
        out_flat = torch.empty(sum(o.numel() for o in outputs), dtype=outputs[0].dtype,
                               device=outputs[0].device)

        def unpack():
            for o, piece in zip(outputs, out_flat.split([o.numel() for o in outputs])):
                o.copy_(piece.view(o.shape))
        in_flat = torch.cat([i.reshape(-1) for i in inputs])
        return self._run("all_to_all", opts, lambda: [self.comm.all_to_all_single(
            out_flat, in_flat, [o.numel() for o in outputs], [i.numel() for i in inputs],
            async_op=True)], outputs, inputs, finish=[unpack])

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._run("all_to_all_single", opts, lambda: [self.comm.all_to_all_single(
            output, input, output_split_sizes or None, input_split_sizes or None,
            async_op=True)], [output], [input])

    alltoall_base = all_to_all_single

    def reduce_scatter_single(self, output, input, opts=None):
        return self.reduce_scatter_single_coalesced([output], [input], opts, "reduce_scatter_tensor")

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None,
                                        call="reduce_scatter_tensor_coalesced"):
        op, factor = self._reduce_op(opts, call)
        return self._run(call, opts, lambda: [
            self.comm.reduce_scatter_tensor(o, i, op=op, async_op=True, factor=factor)
            for o, i in zip(outputs, inputs)], outputs, inputs)

    _reduce_scatter_base = reduce_scatter_single                  # torch before 2.13
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        flat = [torch.cat([c.reshape(-1) for c in chunks]) for chunks in input_lists]
        return self.reduce_scatter_single_coalesced(outputs, flat, opts, "reduce_scatter")

    def gather(self, output_lists, inputs, opts):
        root = self.comm.rank == opts.rootRank
        return self._run("gather", opts, lambda: [self.comm.gather(
            inputs[0], output_lists[0] if root else None, dst=opts.rootRank, async_op=True)],
            output_lists, inputs)

    def scatter(self, outputs, input_lists, opts):
        root = self.comm.rank == opts.rootRank
        return self._run("scatter", opts, lambda: [self.comm.scatter(
            outputs[0], input_lists[0] if root else None, src=opts.rootRank, async_op=True)],
            outputs, outputs)

    def barrier(self, opts=None):
        return self._run("barrier", opts, lambda: [self.comm.barrier(async_op=True)], [], [])

    def monitored_barrier(self, timeout: datetime.timedelta | float | None = None,
                          wait_all_ranks: bool = False) -> None:
        """gloo's ``monitoredBarrier``: every rank reports to rank 0, which names the ranks that
        did not arrive within ``timeout`` (the first, or all with ``wait_all_ranks``)."""
        if self._broken is not None:
            raise RuntimeError("mpicomm process group: monitored_barrier refused, the group is "
                               f"unusable {self._broken}")
        if self.comm is None:
            raise RuntimeError("mpicomm process group: monitored_barrier on a group that was "
                               "destroyed")
        _monitored.run(self.comm.mpi_comm, self.timeout if timeout is None else timeout,
                       wait_all_ranks)

    # -- point to point ---------------------------------------------------------------------

    def send(self, tensors, dst, tag):
        return self._run("send", None, lambda: [self.comm.isend(t, dst, tag) for t in tensors],
                         tensors, tensors)

    def recv(self, tensors, src, tag, call: str = "recv"):
        works = []
        return self._run(call, None, lambda: works.extend(
            self.comm.irecv(t, src, tag) for t in tensors) or works, tensors, tensors,
            source=_Lazy(works))

    def recv_anysource(self, tensors, tag):
        return self.recv(tensors, None, tag, "recvAnySource")  # torch's profiler name


class _Lazy:
    """The first receive of a call, known once the call has started."""

    def __init__(self, works: list) -> None:
        self._works = works

    def source_rank(self) -> int:
        return self._works[0].source_rank()
