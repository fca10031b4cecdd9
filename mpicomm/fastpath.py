"""The fast-path rule: plain host tensors go straight to MPI, skipping the general path's no-op steps.

An unchecked collective, blocking or not, takes the fast path when every buffer is a contiguous host
``torch.Tensor`` of one dtype MPI takes as it is, the buffers do not overlap, their sizes are what
the operation requires, the count fits the MPI library and (for reductions) MPI reduces that dtype
with that op natively. That is exactly when the general path would hand the user's memory to MPI
unchanged. Anything else, including every error, takes the general path; so does a tensor with
torch's negative bit set (``is_neg()``: its memory holds the negated values), which the general
path stages (the remembered-call checks below test it too: ``.data =`` can turn a remembered
tensor into one without changing its address, size or dtype).

``all_reduce`` (below) is ``Communicator.all_reduce`` itself with the rule in front, inline
(one Python frame between the caller and MPI's Allreduce, SUM found by identity). It,
broadcast, all_gather_into_tensor and reduce_scatter_tensor remember their last fast call
(blocking or not) on tensors of at most :data:`REMEMBER_BYTES`: the same tensors again, with the
same op (or root), reuse that call's MPI buffers once each tensor's address, size, dtype,
contiguity, device and negative bit are read again and found unchanged (the tensor's version
counter would not do: ``.data =``, ``share_memory_``, ``swap_tensors`` and ``_set_neg`` change a
tensor without counting, and every write counts). Those six reads per tensor are what a
remembered call costs above MPI's own call; tests/test_cco_fastpath.py changes each of them in
place while keeping the others (the device aside: no other device there; tests/test_cco_native.py
swaps in a meta tensor). The check is written out in each function: a helper per tensor would
add a Python call to every call. When :mod:`mpicomm.native` is built (``python -m
mpicomm.build_native``), ``_same``/``_same2`` make the same six reads per tensor in one C call
with torch's own C++ accessors. A ``factor`` (PREMUL_SUM) always takes the general path.
all_to_all_single gets the rule the same way and asks :func:`_plain` for the MPI spec of a
tensor's memory it has seen before.

Where a remembered 8-byte call's time goes (``python -m bench.fastpath_cost``: one rank, MPICH
5.0.2, thread CPU time, best of 15 x 4000 calls, cases alternating, load 4): torch's Python
getters cost data_ptr() 50 ns, nbytes 38, dtype 35, is_contiguous() 52, is_cpu 36, is_neg() 72
(its argument parser), net of an empty call: about 0.3 us a tensor with the comparisons, 0.6
for two; the rest of the rule (the observing test, the unpacking) about 0.1 us. mpi4py's own
call on numpy arrays costs 0.12 us more than on the prepared ``[buffer, datatype]`` used here
(Allgather 0.58 vs 0.46 us). Over mpi4py on numpy arrays, with the check in Python:
all_reduce +0.21 us, broadcast +0.43, all_gather_into_tensor +0.78, reduce_scatter_tensor
+0.72; in C (28 ns a tensor, 50 for two): all_reduce -0.14 (in place, mpi4py's peer out of
place), broadcast +0.08, all_gather_into_tensor +0.06, reduce_scatter_tensor +0.06.
MPI-4 persistent collectives
(``Allreduce_init`` + ``Start``/``Wait``) were measured and not adopted: on MPICH 5.0.2 at one
rank ``Start(); Wait()`` took 0.83 us of CPU time against 0.25 us for ``Allreduce`` on a
prepared buffer, and at two ranks the difference was lost in the noise.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from mpi4py import MPI

from . import dtypes, large, native, observe
from .observe import _DEBUG, _debug_cached, _profiler
from .ops import BITWISE, MPI_OPS, ReduceOp
from .work import Work

#: Set to False to send every call through the general path (tests compare the two).
ENABLED = True

_fromaddress = MPI.buffer.fromaddress
# (dtype, op) -> (MPI datatype, MPI op) for reductions MPI performs natively on host memory.
REDUCE = {
    (dtype, key): (mpi_type, MPI_OPS[op])
    for dtype, mpi_type in dtypes.NATIVE.items() if dtype != torch.bool
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PROD) + (
        () if dtype in dtypes.FLOATING else BITWISE)
    for key in (op, op.value)
}
_FAST_SUM = {dtype: found for (dtype, op), found in REDUCE.items() if op is ReduceOp.SUM}
_SUM = ReduceOp.SUM
_Tensor = torch.Tensor
_IN_PLACE = MPI.IN_PLACE
#: The fast calls remember their last tensors when the largest is at most this many bytes
#: (holding a reference to them until the next fast call of that kind on the communicator: at
#: most one or two tensors per kind). Measured at 2 ranks: 8 bytes, ~0.5 us per call less when
#: the same tensor comes again, ~0.15 us more of CPU time when it does not; a 1 MiB broadcast
#: 3-5 us less (55.3-55.6 against 58.1-61.2 us, mpi4py on numpy 55.5-56.5 us), the general
#: path's ~0.7 us of CPU time costing more at two ranks than at one. Above a few MiB the
#: transfer hides it, and holding larger tensors would keep memory a caller has let go.
REMEMBER_BYTES = 1 << 22
_NOTHING = object()  # no call remembered (never a caller's argument)
#: What a communicator remembers before its first fast call of each kind, one tuple as long as
#: what that call remembers: ``_last_fast`` (all_reduce: tensor, op, address, bytes, dtype, MPI
#: buffer, MPI op), ``_last_bcast`` (tensor, address, bytes, dtype, MPI buffer, root),
#: ``_last_gather`` (:func:`_remember_pair`) and ``_last_scatter`` (the same, op, MPI op).
NOT_YET_FAST, NOT_YET_BCAST = (_NOTHING,) * 7, (_NOTHING,) * 6
NOT_YET_GATHER, NOT_YET_SCATTER = (_NOTHING,) * 9, (_NOTHING,) * 11
# dtype -> MPI datatype that moves it unchanged.
_MOVE = {dtype: dtypes.move_type(dtype) for dtype in dtypes.SUPPORTED}
_native = native.load()
#: The remembered-call check in C when :mod:`mpicomm.native` is built (``same(t, address,
#: nbytes, dtype)``, ``same2`` for two tensors: the same six facts per tensor); None: in Python.
_same = None if _native is None else _native.same
_same2 = None if _native is None else _native.same2


_PLAIN: dict[tuple, tuple] = {}
_PLAIN_MAX = 256


def _plain(t):
    """(MPI spec, address, bytes, elements, dtype) of a contiguous host ``torch.Tensor`` of a
    dtype MPI moves unchanged, without torch's negative bit; None for anything else.

    Cached by (address, bytes, dtype): ``fromaddress`` costs about 1 us, the lookup a tenth of
    that. An entry describes only memory and a datatype, so it serves any tensor that has them
    (what a tensor is made of is read on every call); a stale one names memory no call touches.
    """
    if type(t) is not _Tensor or not t.is_cpu or not t.is_contiguous() or t.is_neg():
        return None
    key = (t.data_ptr(), t.nbytes, t.dtype)
    found = _PLAIN.get(key)
    if found is None:
        mpi_type = _MOVE.get(key[2])
        if mpi_type is None:
            return None
        if len(_PLAIN) >= _PLAIN_MAX:
            _PLAIN.clear()
        found = _PLAIN[key] = ([_fromaddress(key[0], key[1]), mpi_type], key[0], key[1],
                               t.numel(), key[2])
    return found


def _pair(small, big, ratio: int, parts: int):
    """(small, big) as :func:`_plain` gives them: two tensors of one dtype that do not overlap,
    ``big`` holding ``ratio`` times ``small``'s bytes and ``small`` in ``parts`` parts within
    MPI's counts; None otherwise."""
    s = _plain(small)
    b = None if s is None else _plain(big)
    if (b is None or b[4] is not s[4] or b[2] != ratio * s[2] or s[3] // parts > large.MAX_COUNT
            or (s[1] < b[1] + b[2] and b[1] < s[1] + s[2])):  # dtype, sizes, count, overlap
        return None
    return s, b


def _reduce_op(dtype, op):
    """MPI op reducing ``dtype`` natively with ``op`` (None: not natively, or not an op)."""
    if op is _SUM:  # the default: a dtype-only table (hashing an enum costs ~0.3 us)
        found = _FAST_SUM.get(dtype)
    else:
        try:
            found = REDUCE.get((dtype, op))
        except TypeError:  # an unhashable op: the general path reports it
            return None
    return None if found is None else found[1]


# Each function below is the public method itself: the rule inline in front of the general
# path (a Python frame per call costs about as much as the rest of the rule). The condition
# opening each is the same: unchecked, fast paths on, no profiler or DEBUG log observing
# (observed calls take the general path, which is traced). With ``async_op`` the same MPI call
# starts non-blocking and a Work keeps the tensors until it completes (the process group's
# calls, blocking ones included, all come this way). An MPI error passes through
# ``Communicator._surface`` (a rank failure raises RankFailedError); the try costs nothing until
# something raises.

def broadcast(method: Callable) -> Callable:
    """``Communicator.broadcast``: the rule in front of ``method`` (its general path)."""
    @functools.wraps(method)
    def broadcast(self, tensor, src=0, async_op=False):
        try:
            if (not self.check and ENABLED and not _profiler._is_profiler_enabled
                    and (_debug_cached(_DEBUG) is False or not observe.log.isEnabledFor(_DEBUG))):
                t0, address, nbytes, dtype, spec, src0 = self._last_bcast
                # the same tensor and root as the last fast call (see all_reduce)
                if not (tensor is t0 and src is src0 and (
                        _same(tensor, address, nbytes, dtype) if _same is not None else
                        tensor.data_ptr() == address and tensor.nbytes == nbytes
                        and tensor.dtype is dtype and tensor.is_contiguous() and tensor.is_cpu
                        and not tensor.is_neg())):
                    t = None if type(src) is not int or not 0 <= src < self.size else _plain(tensor)
                    if t is None or t[3] > large.MAX_COUNT:
                        return method(self, tensor, src, async_op)
                    spec = t[0]
                    if t[2] <= REMEMBER_BYTES:
                        self._last_bcast = (tensor, t[1], t[2], t[4], spec, src)
                if async_op:
                    return Work(self.mpi_comm.Ibcast(spec, src), (), [tensor], (tensor,), self)
                self.mpi_comm.Bcast(spec, src)
                return None
            return method(self, tensor, src, async_op)
        except MPI.Exception as exc:  # a rank failure: RankFailedError
            self._raise_surfaced(exc, 'broadcast')

    return broadcast


def _remember_pair(small, big, pair, *more) -> tuple:
    """What a pair call remembers: (small, big, their addresses, bytes, dtype, MPI specs, *more)."""
    s, b = pair
    return (small, big, s[1], b[1], s[2], b[2], s[4], s[0], b[0]) + more


def all_gather_into_tensor(method: Callable) -> Callable:
    """``Communicator.all_gather_into_tensor``: the rule in front of ``method``."""
    @functools.wraps(method)
    def all_gather_into_tensor(self, output_tensor, input_tensor, async_op=False):
        try:
            if (not self.check and ENABLED and not _profiler._is_profiler_enabled
                    and (_debug_cached(_DEBUG) is False or not observe.log.isEnabledFor(_DEBUG))):
                i0, o0, address_i, address_o, nbytes_i, nbytes_o, dtype, send, recv = \
                    self._last_gather
                # the same two tensors as the last fast call (see all_reduce): each checked again
                if not (input_tensor is i0 and output_tensor is o0 and (
                        _same2(input_tensor, output_tensor, address_i, address_o, nbytes_i,
                               nbytes_o, dtype) if _same2 is not None else
                        input_tensor.data_ptr() == address_i
                        and output_tensor.data_ptr() == address_o
                        and input_tensor.nbytes == nbytes_i and output_tensor.nbytes == nbytes_o
                        and input_tensor.dtype is dtype and output_tensor.dtype is dtype
                        and input_tensor.is_contiguous() and output_tensor.is_contiguous()
                        and input_tensor.is_cpu and output_tensor.is_cpu
                        and not (input_tensor.is_neg() or output_tensor.is_neg()))):
                    pair = _pair(input_tensor, output_tensor, self.size, 1)
                    if pair is None:
                        return method(self, output_tensor, input_tensor, async_op)
                    send, recv = pair[0][0], pair[1][0]
                    if pair[1][2] <= REMEMBER_BYTES:
                        self._last_gather = _remember_pair(input_tensor, output_tensor, pair)
                if async_op:
                    return Work(self.mpi_comm.Iallgather(send, recv), (), [output_tensor],
                                (input_tensor, output_tensor), self)
                self.mpi_comm.Allgather(send, recv)
                return None
            return method(self, output_tensor, input_tensor, async_op)
        except MPI.Exception as exc:  # a rank failure: RankFailedError
            self._raise_surfaced(exc, 'all_gather_into_tensor')

    return all_gather_into_tensor


def reduce_scatter_tensor(method: Callable) -> Callable:
    """``Communicator.reduce_scatter_tensor``: the rule in front of ``method``."""
    @functools.wraps(method)
    def reduce_scatter_tensor(self, output, input, op=_SUM, async_op=False, factor=None):
        try:
            if (factor is None and not self.check and ENABLED
                    and not _profiler._is_profiler_enabled
                    and (_debug_cached(_DEBUG) is False or not observe.log.isEnabledFor(_DEBUG))):
                (o0, i0, address_o, address_i, nbytes_o, nbytes_i, dtype, recv, send, op0,
                 mpi_op) = self._last_scatter
                if not (output is o0 and input is i0 and op is op0 and (
                        _same2(output, input, address_o, address_i, nbytes_o, nbytes_i, dtype)
                        if _same2 is not None else
                        output.data_ptr() == address_o and input.data_ptr() == address_i
                        and output.nbytes == nbytes_o and input.nbytes == nbytes_i
                        and output.dtype is dtype and input.dtype is dtype
                        and output.is_contiguous() and input.is_contiguous()
                        and output.is_cpu and input.is_cpu
                        and not (output.is_neg() or input.is_neg()))):
                    pair = _pair(output, input, self.size, 1)
                    mpi_op = None if pair is None else _reduce_op(pair[0][4], op)
                    if mpi_op is None:
                        return method(self, output, input, op, async_op, factor)
                    recv, send = pair[0][0], pair[1][0]
                    if pair[1][2] <= REMEMBER_BYTES:
                        self._last_scatter = _remember_pair(output, input, pair, op, mpi_op)
                if async_op:
                    return Work(self.mpi_comm.Ireduce_scatter_block(send, recv, mpi_op),
                                (), [output], (input, output), self)
                self.mpi_comm.Reduce_scatter_block(send, recv, mpi_op)
                return None
            return method(self, output, input, op, async_op, factor)
        except MPI.Exception as exc:  # a rank failure: RankFailedError
            self._raise_surfaced(exc, 'reduce_scatter_tensor')

    return reduce_scatter_tensor


def all_to_all_single(method: Callable) -> Callable:
    """``Communicator.all_to_all_single``: the rule in front of ``method`` (equal splits)."""
    @functools.wraps(method)
    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          async_op=False):
        try:
            if (output_split_sizes is None and input_split_sizes is None
                    and not self.check and ENABLED and not _profiler._is_profiler_enabled
                    and (_debug_cached(_DEBUG) is False or not observe.log.isEnabledFor(_DEBUG))):
                pair = _pair(output, input, 1, self.size)
                if pair is not None and pair[1][3] % self.size == 0:
                    if async_op:
                        return Work(self.mpi_comm.Ialltoall(pair[1][0], pair[0][0]), (), [output],
                                    (input, output), self)
                    self.mpi_comm.Alltoall(pair[1][0], pair[0][0])
                    return None
            return method(self, output, input, output_split_sizes, input_split_sizes, async_op)
        except MPI.Exception as exc:  # a rank failure: RankFailedError
            self._raise_surfaced(exc, 'all_to_all_single')

    return all_to_all_single


def all_reduce(method: Callable) -> Callable:
    """``Communicator.all_reduce``: the rule inline in front of ``method`` (its general path)."""
    @functools.wraps(method)
    def all_reduce(self, tensor, op=_SUM, async_op=False, factor=None):
        try:
            if (factor is None and not self.check and ENABLED
                    and not _profiler._is_profiler_enabled
                    and (_debug_cached(_DEBUG) is False or not observe.log.isEnabledFor(_DEBUG))):
                t0, op0, address, nbytes, dtype, spec, mpi_op = self._last_fast
                # The small tensor and op of the last fast call again (a flag, a metric, a bucket
                # reduced step after step): its MPI buffer is reused while the tensor keeps the
                # same memory, size, dtype and layout, which is checked on every call.
                if not (tensor is t0 and op is op0 and (
                        _same(tensor, address, nbytes, dtype) if _same is not None else
                        tensor.data_ptr() == address and tensor.nbytes == nbytes
                        and tensor.dtype is dtype and tensor.is_contiguous() and tensor.is_cpu
                        and not tensor.is_neg())):
                    t = _plain(tensor)
                    mpi_op = None if t is None or t[3] > large.MAX_COUNT else _reduce_op(t[4], op)
                    if mpi_op is None:
                        return method(self, tensor, op, async_op, factor)
                    spec = t[0]
                    if t[2] <= REMEMBER_BYTES:
                        self._last_fast = (tensor, op, t[1], t[2], t[4], spec, mpi_op)
                if async_op:
                    return Work(self.mpi_comm.Iallreduce(_IN_PLACE, spec, mpi_op), (), [tensor],
                                (tensor,), self)
                self.mpi_comm.Allreduce(_IN_PLACE, spec, mpi_op)
                return None
            return method(self, tensor, op, async_op, factor)
        except MPI.Exception as exc:  # a rank failure: RankFailedError
            self._raise_surfaced(exc, 'all_reduce')

    return all_reduce
