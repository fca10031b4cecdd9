"""Horovod's collectives on torch tensors: allreduce, allgather, broadcast, alltoall,
reducescatter (plain, in place, async, grouped), join and barrier."""
from __future__ import annotations

import warnings

import torch

from . import calls
from .basics import _need, wait
from .calls import Adasum, Average, Sum
from .handles import new_handle
from .process_sets import ProcessSet, global_process_set


def resolve_op(call: str, average, op) -> int:
    """Horovod's op from ``average`` (deprecated) and ``op`` (default Average)."""
    if op is not None and average is not None:
        raise ValueError(f"{call}: pass op= or the deprecated average=, not both")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    op = Average if op is None else op
    if op == Adasum:
        raise NotImplementedError(
            f"{call}: op=hvd.Adasum is not provided by mpicomm.horovod; use op=hvd.Average "
            "(or hvd.Sum), or DistributedOptimizer(compression=hvd.Compression.onebit) to cut "
            "the bytes sent")
    if op not in calls.OP_NAMES:
        raise ValueError(f"{call}: op must be one of hvd.Average, Sum, Min, Max, Product "
                         f"(got {op!r})")
    return op


def _engine(call: str, process_set: ProcessSet):
    _need()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{call}: process_set must be an hvd.ProcessSet, got {type(process_set).__name__}")
    return process_set._live(call)


def _tensor(call: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{call}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _submit_error(eng, label: str, exc: Exception):
    """Send an ERROR round in place of a call that failed here (the others raise too), raise."""
    eng.submit(calls.ErrorOp(label))
    raise exc


def set_rank_of(call: str, root_rank, process_set: ProcessSet) -> int:
    """The rank within ``process_set`` of ``root_rank`` (a rank of the job, as in Horovod)."""
    ranks = process_set.ranks
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank not in ranks:
        raise ValueError(f"{call}: root_rank must be a rank of the process set {ranks} "
                         f"(ranks of the job), got {root_rank!r}")
    return ranks.index(root_rank)


# -- allreduce ---------------------------------------------------------------------------------

def _allreduce_ops(call, tensors, average, name, op, prescale, postscale, process_set, inplace):
    eng = _engine(call, process_set)
    code = resolve_op(call, average, op)
    ops = []
    for i, t in enumerate(tensors):
        t = _tensor(call, t)
        if t.is_sparse:
            raise ValueError(f"{call}: sparse tensors go through hvd.sparse_allreduce_async "
                             "(or to_dense() first)")
        out = t if inplace else t.detach().clone(memory_format=torch.contiguous_format)
        if inplace and not t.is_contiguous():
            raise ValueError(f"{call}: in-place calls need a contiguous tensor")
        n = name if len(tensors) == 1 or name is None else f"{name}.{i}"
        ops.append(eng.submit(calls.AllreduceOp(call, out, n, code, float(prescale),
                                                float(postscale))))
    return ops


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> int:
    ops = _allreduce_ops("allreduce_async", [tensor], average, name, op, prescale_factor,
                         postscale_factor, process_set, False)
    return new_handle(ops, lambda o: o[0].result)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    ops = _allreduce_ops("allreduce_async_", [tensor], average, name, op, prescale_factor,
                         postscale_factor, process_set, True)
    return new_handle(ops, lambda o: tensor)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    from .handles import synchronize
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    ops = _allreduce_ops("grouped_allreduce_async", list(tensors), average, name, op,
                         prescale_factor, postscale_factor, process_set, False)
    return new_handle(ops, lambda o: [x.result for x in o])


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    tensors = list(tensors)
    ops = _allreduce_ops("grouped_allreduce_async_", tensors, average, name, op,
                         prescale_factor, postscale_factor, process_set, True)
    return new_handle(ops, lambda o: tensors)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    from .handles import synchronize
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# -- allgather ---------------------------------------------------------------------------------

def _allgather_ops(call, tensors, name, process_set):
    eng = _engine(call, process_set)
    return [eng.submit(calls.AllgatherOp(call, _tensor(call, t).detach(),
                                         name if len(tensors) == 1 or name is None else f"{name}.{i}"))
            for i, t in enumerate(tensors)]


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    return new_handle(_allgather_ops("allgather_async", [tensor], name, process_set),
                      lambda o: o[0].result)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    return new_handle(_allgather_ops("grouped_allgather_async", list(tensors), name, process_set),
                      lambda o: [x.result for x in o])


# -- broadcast ---------------------------------------------------------------------------------

def _broadcast_op(call, tensor, root_rank, name, process_set, inplace):
    eng = _engine(call, process_set)
    t = _tensor(call, tensor)
    root = set_rank_of(call, root_rank, process_set)
    if inplace and not t.is_contiguous():
        raise ValueError(f"{call}: in-place calls need a contiguous tensor")
    out = t if inplace else t.detach().clone(memory_format=torch.contiguous_format)
    return [eng.submit(calls.BroadcastOp(call, out, name, root))]


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    return new_handle(_broadcast_op("broadcast_async", tensor, root_rank, name, process_set,
                                    False), lambda o: o[0].result)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    return new_handle(_broadcast_op("broadcast_async_", tensor, root_rank, name, process_set,
                                    True), lambda o: tensor)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    from .handles import synchronize
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall ----------------------------------------------------------------------------------

def _alltoall_op(call, tensor, splits, name, process_set):
    eng = _engine(call, process_set)
    t = _tensor(call, tensor).detach()
    n = eng.size
    try:
        if t.dim() == 0:
            raise ValueError(f"{call}: a scalar cannot be split; pass a tensor of at least one "
                             "dimension")
        if splits is None:
            if t.shape[0] % n:
                raise ValueError(f"{call}: without splits the first dimension ({t.shape[0]}) "
                                 f"must be divisible by the number of ranks ({n})")
            sp = [t.shape[0] // n] * n
        else:
            st = torch.as_tensor(splits)
            if st.dtype != torch.int32:
                raise ValueError(f"{call}: splits must be an int32 tensor (got {st.dtype})")
            sp = [int(x) for x in st.cpu().reshape(-1)]
            if len(sp) != n or any(x < 0 for x in sp):
                raise ValueError(f"{call}: splits must hold {n} non-negative entries, one per "
                                 f"rank (got {sp})")
            if sum(sp) > t.shape[0]:
                raise ValueError(f"{call}: the splits sum to {sum(sp)}, more than the first "
                                 f"dimension of the tensor ({t.shape[0]})")
    except ValueError as exc:
        _submit_error(eng, call, exc)
    return [eng.submit(calls.AlltoallOp(call, t, name, sp, splits is not None))]


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    given = splits is not None
    dev = splits.device if isinstance(splits, torch.Tensor) else None
    return new_handle(_alltoall_op("alltoall_async", tensor, splits, name, process_set),
                      lambda o: _alltoall_result(o[0].result, given, dev))


def _alltoall_result(result, given, dev):
    out, recv = result
    if not given:
        return out
    return out, (recv.to(dev) if dev is not None else recv)


# -- reducescatter -----------------------------------------------------------------------------

def _reducescatter_ops(call, tensors, name, op, prescale, postscale, process_set):
    eng = _engine(call, process_set)
    code = resolve_op(call, None, op)
    ops = []
    for i, t in enumerate(tensors):
        t = _tensor(call, t).detach()
        if t.dim() == 0:
            raise ValueError(f"{call}: a scalar cannot be scattered; pass a tensor of at least "
                             "one dimension")
        n = name if len(tensors) == 1 or name is None else f"{name}.{i}"
        ops.append(eng.submit(calls.ReducescatterOp(call, t, n, code, float(prescale),
                                                    float(postscale))))
    return ops


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    return new_handle(_reducescatter_ops("reducescatter_async", [tensor], name, op,
                                         prescale_factor, postscale_factor, process_set),
                      lambda o: o[0].result)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    return new_handle(_reducescatter_ops("grouped_reducescatter_async", list(tensors), name, op,
                                         prescale_factor, postscale_factor, process_set),
                      lambda o: [x.result for x in o])


# -- join and barrier --------------------------------------------------------------------------

def join(device: int = -1) -> int:
    """Take part (with zeros) in the other ranks' allreduces until every rank has joined;
    returns the rank that joined last (the same on every rank)."""
    eng = _engine("join", global_process_set)
    while True:
        op = eng.submit(calls.JoinOp("join", device))
        wait([op])
        if op.error is not None:
            raise op.error
        if op.result is not None:
            return op.result[1]


def barrier(process_set=global_process_set) -> None:
    """Block until every rank of ``process_set`` reaches the barrier (calls in flight go on)."""
    eng = _engine("barrier", process_set)
    req = eng.fence.Ibarrier()
    spins = 0
    import time
    from .basics import engines
    while not req.Test():
        moved = False
        for e in engines():
            if e.pending():
                moved |= e.progress()
        spins = 0 if moved else spins + 1
        if spins > 100:
            time.sleep(min(1e-3, 1e-5 * spins))
