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
call's sequence number, so that a non-blocking call (:class:`Steps`, completed by
``Work.wait()``, ``is_completed()`` or the progress thread) may issue its later phases in
any order relative to other calls without mismatching them. Tests force the pipelined path
with small thresholds through ``MPICOMM_REDUCE16_SMALL`` and ``MPICOMM_REDUCE16_SEGMENT``
(bytes) or by setting the module's attributes.
"""
from __future__ import annotations

import os
import threading
from typing import Iterator

import numpy as np
import torch
from mpi4py import MPI

from . import kernels16, large
from .device_paths import DevicePolicy
from .ops import ReduceOp

#: The dtypes reduced here.
DTYPES = (torch.bfloat16, torch.float16)
#: Buffers of fewer bytes take the one-collective path (whole buffer).
SMALL_BYTES = int(os.environ.get("MPICOMM_REDUCE16_SMALL", 64 << 10))
#: Bytes of one segment of an owner block in the pipelined path.
SEGMENT_BYTES = int(os.environ.get("MPICOMM_REDUCE16_SEGMENT", 4 << 20))
#: Segments whose exchange is posted ahead of the kernel.
DEPTH = 2
#: Device buffers are staged through host memory: the kernel runs on the host.
HOST_ONLY = DevicePolicy(False, "16-bit reductions combine on the host")

_U16 = MPI.UINT16_T
_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def host_policy() -> DevicePolicy:
    """The device policy of 16-bit reductions: staged (the kernel runs on host memory)."""
    return HOST_ONLY


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
    """Reusable uint16 host buffers by power-of-two size class (no page faults per call)."""

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def acquire(self, numel: int) -> np.ndarray:
        size = 1 << max(numel - 1, 0).bit_length()
        with self._lock:
            bucket = self._free.get(size)
            raw = bucket.pop() if bucket else None
        return np.empty(size, np.uint16) if raw is None else raw

    def release(self, raw: np.ndarray) -> None:
        with self._lock:
            self._free.setdefault(raw.size, []).append(raw)


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


class Steps:
    """A request over a multi-phase reduction (mirrors ``MPI.Request``'s Wait/Test for Work).

    ``steps`` yields lists of requests to complete before it continues; creating a Steps runs
    it up to its first wait, so a call's first messages go out when the call is made.
    """

    def __init__(self, steps: Iterator[list], release=()) -> None:
        self._steps = steps
        self._release = list(release)
        self._reqs: list | None = None
        self._advance()

    def _advance(self) -> None:
        try:
            self._reqs = next(self._steps)
        except StopIteration:
            self._reqs = None
            for fn in self._release:
                fn()
            self._release = []

    def Wait(self, status: MPI.Status | None = None) -> None:  # noqa: N802 - as MPI.Request
        """Run every remaining phase."""
        while self._reqs is not None:
            MPI.Request.Waitall(self._reqs)
            self._advance()

    def Test(self, status: MPI.Status | None = None) -> bool:  # noqa: N802
        """Advance as far as completed messages allow; whether everything is done."""
        while self._reqs is not None:
            if not MPI.Request.Testall(self._reqs):
                return False
            self._advance()
        return True


def _bits(t: torch.Tensor) -> np.ndarray:
    return kernels16.as_bits(t.reshape(-1))


def _small(numel: int, p: int) -> bool:
    """Whether a buffer of ``numel`` elements takes the one-collective path."""
    return (numel * 2 < SMALL_BYTES or p == 1) and numel * p <= large.MAX_COUNT


def _balanced(n: int, p: int) -> list[tuple[int, int]]:
    return [(j * n // p, (j + 1) * n // p - j * n // p) for j in range(p)]


def all_reduce(state: State, x: torch.Tensor, plan: tuple[int, int, float]) -> Steps:
    """Start reducing the contiguous host 16-bit tensor ``x`` in place on every rank."""
    comm = state.comm()
    p, me = comm.Get_size(), comm.Get_rank()
    xb, dtype = _bits(x), _NAMES[x.dtype]
    if _small(xb.size, p):
        raw = state.scratch.acquire(p * xb.size)
        return Steps(_small_all_reduce(comm, xb, raw, dtype, plan),
                     [lambda: state.scratch.release(raw)])
    blocks = _balanced(xb.size, p)
    lo, n_me = blocks[me]
    return _pipelined(state, comm, xb, blocks, xb[lo:lo + n_me], dtype, plan, gather="all",
                      dest=xb)


def reduce_scatter(state: State, out: torch.Tensor, inp: torch.Tensor,
                   plan: tuple[int, int, float]) -> Steps:
    """Start reducing host ``inp`` (p equal chunks) into host ``out`` (this rank's chunk)."""
    comm = state.comm()
    p, me = comm.Get_size(), comm.Get_rank()
    ib, ob, dtype = _bits(inp), _bits(out), _NAMES[inp.dtype]
    if _small(ib.size, p):
        raw = state.scratch.acquire(ib.size)
        return Steps(_small_reduce_scatter(comm, ib, ob, raw, dtype, plan),
                     [lambda: state.scratch.release(raw)])
    b = ob.size
    return _pipelined(state, comm, ib, [(j * b, b) for j in range(p)], ob, dtype, plan,
                      gather=None, dest=None)


def reduce(state: State, x: torch.Tensor, dst: int, plan: tuple[int, int, float]) -> Steps:
    """Start reducing host ``x`` into ``x`` on rank ``dst`` (others keep theirs)."""
    comm = state.comm()
    p, me = comm.Get_size(), comm.Get_rank()
    xb, dtype = _bits(x), _NAMES[x.dtype]
    if _small(xb.size, p):
        raw = state.scratch.acquire(p * xb.size if me == dst else 1)
        return Steps(_small_reduce(comm, xb, raw, dst, dtype, plan),
                     [lambda: state.scratch.release(raw)])
    blocks = _balanced(xb.size, p)
    lo, n_me = blocks[me]
    if me == dst:
        return _pipelined(state, comm, xb, blocks, xb[lo:lo + n_me], dtype, plan, gather=dst,
                          dest=xb)
    raw = state.scratch.acquire(max(n_me, 1))
    return _pipelined(state, comm, xb, blocks, raw[:n_me], dtype, plan, gather=dst, dest=None,
                      release=[lambda: state.scratch.release(raw)])


# -- the one-collective path ----------------------------------------------------------------

def _small_all_reduce(comm, xb, raw, dtype, plan):
    p, n = comm.Get_size(), xb.size
    rows = raw[:p * n].reshape(p, n)
    if n:
        yield [comm.Iallgather([xb, _U16], [rows, _U16])]
        kernels16.reduce_rows(rows, None, -1, xb, dtype, *plan)


def _small_reduce_scatter(comm, ib, ob, raw, dtype, plan):
    p, b = comm.Get_size(), ob.size
    rows = raw[:p * b].reshape(p, b)
    if b:
        yield [comm.Ialltoall([ib, _U16], [rows, _U16])]
        kernels16.reduce_rows(rows, None, -1, ob, dtype, *plan)


def _small_reduce(comm, xb, raw, dst, dtype, plan):
    p, n, root = comm.Get_size(), xb.size, comm.Get_rank() == dst
    if not n:
        return
    rows = raw[:p * n].reshape(p, n) if root else None
    yield [comm.Igather([xb, _U16], [rows, _U16] if root else None, root=dst)]
    if root:
        kernels16.reduce_rows(rows, None, -1, xb, dtype, *plan)


# -- the pipelined path ---------------------------------------------------------------------

def _pipelined(state, comm, src, blocks, res, dtype, plan, gather, dest, release=()) -> Steps:
    p = comm.Get_size()
    seg = max(1, min(SEGMENT_BYTES // 2, large.MAX_COUNT))
    longest = max(n for _, n in blocks)
    k_all = -(-longest // seg)
    width = max(1, min(DEPTH, k_all))
    raw = state.scratch.acquire(max(1, width * p * min(seg, longest)))
    steps = _segments(comm, state.next_tag(), src, blocks, res, dtype, plan, gather, dest,
                      seg, k_all, width, raw)
    return Steps(steps, [lambda: state.scratch.release(raw), *release])


def _segments(comm, tag, src, blocks, res, dtype, plan, gather, dest, seg, k_all, width, raw):
    """The pipelined schedule (a generator of request lists to wait for)."""
    p, me = comm.Get_size(), comm.Get_rank()
    cols = min(seg, max(n for _, n in blocks))
    slots = raw[:width * p * cols].reshape(width, p, cols)
    peers = [j for j in range(p) if j != me]
    recv1: list[list] = [[] for _ in range(k_all)]
    send1: list[list] = [[] for _ in range(k_all)]
    phase2: list = []
    tag2 = tag + 1

    def part(j: int, k: int) -> tuple[int, int]:
        lo, n = blocks[j]
        start = k * seg
        return lo + start, max(0, min(n - start, seg))

    def post(k: int) -> None:
        slot = slots[k % width]
        _, m = part(me, k)
        if m:
            recv1[k] = [comm.Irecv([slot[r, :m], _U16], r, tag) for r in peers]
        for j in peers:
            a, mj = part(j, k)
            if mj:
                send1[k].append(comm.Isend([src[a:a + mj], _U16], j, tag))

    for k in range(width):
        post(k)
    for k in range(k_all):
        if recv1[k]:
            yield recv1[k]
        a, m = part(me, k)
        out = res[k * seg:k * seg + m]
        if m:
            kernels16.reduce_rows(slots[k % width, :, :m], src[a:a + m], me, out, dtype, *plan)
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
                    phase2.append(comm.Irecv([dest[aj:aj + mj], _U16], j, tag2))
        if m:
            for j in (peers if gather == "all" else [gather] if gather != me else []):
                phase2.append(comm.Isend([out, _U16], j, tag2))
    rest = phase2 + [r for reqs in send1 for r in reqs]
    if rest:
        yield rest
