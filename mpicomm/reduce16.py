"""bfloat16/float16 reductions with 16 bits on the wire: all_reduce, reduce_scatter, reduce.

MPI has no 16-bit float type, so these reductions are built from moves and a local kernel.
The result is what mpicomm has always promised: the float32 sum of the ranks' values (in rank
order), scaled in float32 for AVG (divided by the rank count) or PREMUL_SUM (times the
factor), rounded once to 16 bits, identical on every rank. MAX and MIN are exact.

Large buffers (at least :data:`SMALL_BYTES`) are cut into p owner blocks (``reduce_scatter``:
the output chunks), and each block into segments of at most :data:`SEGMENT_BYTES`. For every
segment, each rank sends the other owners their part of it (point-to-point, 16-bit), the owner
combines the p parts with one fused pass (``kernels16``) and, for ``all_reduce``, sends its
16-bit result to every rank (``reduce``: to the root). :data:`DEPTH` segments are in flight
ahead of the kernel, so kernels overlap transfers. Small buffers take one collective issued
at call time (``all_reduce``: an allgather of every rank's buffer, ``reduce_scatter``: an
all-to-all, ``reduce``: a gather to the root) and the same kernel over all rows.

The point-to-point phases run on a private duplicate of the communicator, tagged with the
call's sequence number, so that a non-blocking call (a ``mpicomm.requests.Requests`` over the
phases, completed by ``Work.wait()``, ``is_completed()`` or the progress thread) may issue its
later phases in any order relative to other calls without mismatching them. Tests force the
pipelined path with small thresholds through ``MPICOMM_REDUCE16_SMALL`` and
``MPICOMM_REDUCE16_SEGMENT`` (bytes) or by setting the module's attributes.

Device buffers follow the communicator's device policy (:func:`device_policy`): when MPI takes
device memory for every call made here, they go to MPI as they are, scratch memory is on the
same device and the combine runs there (torch kernels, the stream synchronised before MPI
touches what a kernel wrote or read); otherwise they are staged through host memory and
combined on the host. :data:`TORCH_BUFFERS` runs host tensors through the device code (tests).
"""
from __future__ import annotations

import os
import threading

import numpy as np
import torch
from mpi4py import MPI

from . import kernels16, large
from .device_paths import DevicePolicy
from .ops import ReduceOp
from .requests import Requests, kept_on_failure

#: The dtypes reduced here.
DTYPES = (torch.bfloat16, torch.float16)
#: Buffers of fewer bytes take the one-collective path (whole buffer).
SMALL_BYTES = int(os.environ.get("MPICOMM_REDUCE16_SMALL", 64 << 10))
#: Bytes of one segment of an owner block in the pipelined path.
SEGMENT_BYTES = int(os.environ.get("MPICOMM_REDUCE16_SEGMENT", 4 << 20))
#: Segments whose exchange is posted ahead of the kernel.
DEPTH = 2
#: Run host tensors through the device-buffer code (torch kernels, raw addresses): for tests.
TORCH_BUFFERS = os.environ.get("MPICOMM_REDUCE16_TORCH_BUFFERS", "") == "1"
#: The MPI calls the 16-bit reductions make; device buffers go direct only if MPI takes them for all.
MPI_CALLS = ("isend", "irecv", "iallgather", "ialltoall", "igather")

_U16 = MPI.UINT16_T
_fromaddress = MPI.buffer.fromaddress
_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def device_policy(base: DevicePolicy) -> DevicePolicy:
    """The device policy of 16-bit reductions, from the communicator's: direct when ``base`` lets
    device buffers go straight to every call in :data:`MPI_CALLS`, else staged through the host."""
    if all(base.direct(c) for c in MPI_CALLS):
        return DevicePolicy(True, base.reason)
    refused = [c for c in MPI_CALLS if not base.direct(c)]
    return DevicePolicy(False, f"staged: MPI does not take device buffers for {', '.join(refused)} "
                               f"({base.reason})")


def plan_op(op: ReduceOp, size: int, factor=None) -> tuple[int, int, float] | None:
    """(combine kind, mode, scale) for ``op`` (and PREMUL_SUM's ``factor``), or None when the
    op is not done here (PROD: the float32 upcast path)."""
    if factor is not None:
        return kernels16.SUM, kernels16.MULTIPLY, float(factor)
    if op is ReduceOp.SUM:
        return kernels16.SUM, kernels16.PLAIN, 1.0
    if op is ReduceOp.AVG:
        return kernels16.SUM, kernels16.DIVIDE, float(size)
    if op is ReduceOp.MAX:
        return kernels16.MAX, kernels16.PLAIN, 1.0
    if op is ReduceOp.MIN:
        return kernels16.MIN, kernels16.PLAIN, 1.0
    return None


class _Scratch:
    """Reusable 16-bit buffers (uint16 numpy on the host, int16 torch on a device) by device and
    power-of-two size class (no page faults or allocator calls per call)."""

    def __init__(self) -> None:
        self._free: dict[tuple, list] = {}
        self._lock = threading.Lock()

    def acquire(self, numel: int, device: torch.device | None = None):
        size = 1 << max(numel - 1, 0).bit_length()
        with self._lock:
            bucket = self._free.get((device, size))
            raw = bucket.pop() if bucket else None
        if raw is not None:
            return raw
        if device is None:
            return np.empty(size, np.uint16)
        return torch.empty(size, dtype=torch.int16, device=device)

    def release(self, raw, device: torch.device | None = None) -> None:
        size = raw.size if device is None else raw.numel()
        with self._lock:
            self._free.setdefault((device, size), []).append(raw)


class _Host:
    """Host buffers: numpy uint16 views, MPI reads them through the buffer protocol, the fused
    host kernel combines."""

    device = None

    @staticmethod
    def bits(t: torch.Tensor) -> np.ndarray:
        return kernels16.as_bits(t.reshape(-1))

    @staticmethod
    def buf(a: np.ndarray) -> list:
        return [a, _U16]

    @staticmethod
    def combine(rows, own, me, out, dtype, plan) -> None:
        kernels16.reduce_rows(rows, own, me, out, dtype, *plan)


class _Torch:
    """Torch buffers (device memory MPI takes directly): int16 views, MPI gets their addresses,
    torch kernels combine on their device; the device is synchronised after each combine, so
    that MPI neither sends a result nor overwrites an input before the kernel is done."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @staticmethod
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.int16)

    @staticmethod
    def buf(a: torch.Tensor) -> list:
        return [_fromaddress(a.data_ptr(), a.numel() * 2), _U16]

    def combine(self, rows, own, me, out, dtype, plan) -> None:
        kernels16.reduce_rows_bits(rows, own, me, out, dtype, *plan)
        if self.device.type != "cpu":
            from accelerators import get_accelerator

            get_accelerator().stream_synchronize(self.device)


def _memory(t: torch.Tensor):
    """How the buffers of a call on ``t`` are handled (host, or torch on ``t``'s device)."""
    if t.is_cpu and not TORCH_BUFFERS:
        return _Host
    return _Torch(t.device)


class State:
    """Per-communicator state: the private communicator, the call counter, scratch memory."""

    def __init__(self, mpi_comm: MPI.Intracomm, tag_ub: int) -> None:
        self._parent = mpi_comm
        self._comm: MPI.Intracomm | None = None
        self._calls = 0
        self._tags = max(1, (tag_ub + 1) // 2)
        self.scratch = _Scratch()

    def comm(self) -> MPI.Intracomm:
        """The private duplicate (collective on first use, which every rank reaches in order)."""
        if self._comm is None:
            self._comm = self._parent.Dup()
        return self._comm

    def next_tag(self) -> int:
        """The even tag of this call (phase 1; the odd one after it is phase 2)."""
        tag = 2 * (self._calls % self._tags)
        self._calls += 1
        return tag

    def free(self) -> None:
        if self._comm is not None:
            self._comm.Free()
            self._comm = None


def _small(numel: int, p: int) -> bool:
    """Whether a buffer of ``numel`` elements takes the one-collective path."""
    return (numel * 2 < SMALL_BYTES or p == 1) and numel * p <= large.MAX_COUNT


def _balanced(n: int, p: int) -> list[tuple[int, int]]:
    return [(j * n // p, (j + 1) * n // p - j * n // p) for j in range(p)]


def _scratch(state: State, mem, numel: int):
    """Scratch of ``numel`` elements or more in ``mem``'s memory, and the callback that returns it."""
    raw = state.scratch.acquire(numel, mem.device)
    return raw, (lambda: state.scratch.release(raw, mem.device))


def _opening(state: State, x: torch.Tensor):
    """What every call opens with: (private communicator, size, rank, memory kind, ``x``'s bit
    view, dtype name)."""
    comm = state.comm()
    mem = _memory(x)
    return comm, comm.Get_size(), comm.Get_rank(), mem, mem.bits(x), _NAMES[x.dtype]


def all_reduce(state: State, x: torch.Tensor, plan: tuple[int, int, float]) -> Requests:
    """Start reducing the contiguous 16-bit tensor ``x`` in place on every rank."""
    comm, p, me, mem, xb, dtype = _opening(state, x)
    n = xb.shape[0]
    if _small(n, p):
        raw, release = _scratch(state, mem, p * n)
        rows = raw[:p * n].reshape(p, n)
        return Requests(_one_collective(lambda: comm.Iallgather(mem.buf(xb), mem.buf(rows)),
                                        mem, rows, xb, dtype, plan), [release])
    blocks = _balanced(n, p)
    lo, n_me = blocks[me]
    return _pipelined(state, mem, comm, xb, blocks, xb[lo:lo + n_me], dtype, plan, gather="all",
                      dest=xb)


def reduce_scatter(state: State, out: torch.Tensor, inp: torch.Tensor,
                   plan: tuple[int, int, float]) -> Requests:
    """Start reducing ``inp`` (p equal chunks) into ``out`` (this rank's chunk), both contiguous
    and in the same memory."""
    comm, p, _, mem, ib, dtype = _opening(state, inp)
    ob = mem.bits(out)
    b = ob.shape[0]
    if _small(ib.shape[0], p):
        raw, release = _scratch(state, mem, ib.shape[0])
        rows = raw[:p * b].reshape(p, b)
        return Requests(_one_collective(lambda: comm.Ialltoall(mem.buf(ib), mem.buf(rows)),
                                        mem, rows, ob, dtype, plan), [release])
    return _pipelined(state, mem, comm, ib, [(j * b, b) for j in range(p)], ob, dtype, plan,
                      gather=None, dest=None)


def reduce(state: State, x: torch.Tensor, dst: int, plan: tuple[int, int, float]) -> Requests:
    """Start reducing the contiguous ``x`` into ``x`` on rank ``dst`` (others keep theirs)."""
    comm, p, me, mem, xb, dtype = _opening(state, x)
    n = xb.shape[0]
    if _small(n, p):
        raw, release = _scratch(state, mem, p * n if me == dst else 1)
        rows = raw[:p * n].reshape(p, n) if me == dst else None
        return Requests(_one_collective(
            lambda: comm.Igather(mem.buf(xb), None if rows is None else mem.buf(rows), root=dst),
            mem, rows, xb, dtype, plan), [release])
    blocks = _balanced(n, p)
    lo, n_me = blocks[me]
    if me == dst:
        return _pipelined(state, mem, comm, xb, blocks, xb[lo:lo + n_me], dtype, plan, gather=dst,
                          dest=xb)
    raw, release = _scratch(state, mem, max(n_me, 1))
    return _pipelined(state, mem, comm, xb, blocks, raw[:n_me], dtype, plan, gather=dst, dest=None,
                      release=[release])


# -- the one-collective path ----------------------------------------------------------------

def _one_collective(start, mem, rows, out, dtype, plan):
    """The one-collective path: ``start()`` fills ``rows`` (p rows), then one combine writes
    ``out`` (no combine where ``rows`` is None: reduce's other ranks; nothing for no elements)."""
    if not out.shape[0]:
        return
    yield [start()]
    if rows is not None:
        mem.combine(rows, None, -1, out, dtype, plan)


# -- the pipelined path ---------------------------------------------------------------------

def _pipelined(state, mem, comm, src, blocks, res, dtype, plan, gather, dest, release=()) -> Requests:
    p = comm.Get_size()
    seg = max(1, min(SEGMENT_BYTES // 2, large.MAX_COUNT))
    longest = max(n for _, n in blocks)
    k_all = -(-longest // seg)
    width = max(1, min(DEPTH, k_all))
    raw, free = _scratch(state, mem, max(1, width * p * min(seg, longest)))
    steps = _segments(mem, comm, state.next_tag(), src, blocks, res, dtype, plan, gather, dest,
                      seg, k_all, width, raw)
    return Requests(steps, [free, *release])


def _segments(mem, comm, tag, src, blocks, res, dtype, plan, gather, dest, seg, k_all, width, raw):
    """The pipelined schedule (a generator of request lists to wait for)."""
    p, me = comm.Get_size(), comm.Get_rank()
    cols = min(seg, max(n for _, n in blocks))
    slots = raw[:width * p * cols].reshape(width, p, cols)
    peers = [j for j in range(p) if j != me]
    recv1: list[list] = [[] for _ in range(k_all)]
    send1: list[list] = [[] for _ in range(k_all)]
    phase2: list = []
    tag2 = tag + 1
    buf = mem.buf

    def part(j: int, k: int) -> tuple[int, int]:
        lo, n = blocks[j]
        start = k * seg
        return lo + start, max(0, min(n - start, seg))

    def post(k: int) -> None:
        slot = slots[k % width]
        _, m = part(me, k)
        if m:
            for r in peers:  # appended one by one: each is in recv1 as soon as it is posted
                recv1[k].append(comm.Irecv(buf(slot[r, :m]), r, tag))
        for j in peers:
            a, mj = part(j, k)
            if mj:
                send1[k].append(comm.Isend(buf(src[a:a + mj]), j, tag))

    # an MPI error (a peer died, the communicator was revoked) or a close leaves this frame with
    # requests still pending over slots and the caller's tensors
    with kept_on_failure(recv1, send1, phase2, slots):
        for k in range(width):
            post(k)
        for k in range(k_all):
            if recv1[k]:
                yield recv1[k]
            a, m = part(me, k)
            out = res[k * seg:k * seg + m]
            if m:
                mem.combine(slots[k % width, :, :m], src[a:a + m], me, out, dtype, plan)
            if k + width < k_all:
                post(k + width)
            if gather is None:
                continue
            if dest is not None:  # results of the other owners land where this rank's sends read
                if send1[k]:
                    yield send1[k]
                    send1[k] = []
                for j in peers:
                    aj, mj = part(j, k)
                    if mj:
                        phase2.append(comm.Irecv(buf(dest[aj:aj + mj]), j, tag2))
            if m:
                for j in (peers if gather == "all" else [gather] if gather != me else []):
                    phase2.append(comm.Isend(buf(out), j, tag2))
        rest = phase2 + [r for reqs in send1 for r in reqs]
        if rest:
            yield rest
