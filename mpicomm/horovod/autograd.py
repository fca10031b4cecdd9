"""The blocking collectives, differentiable as in Horovod (the gradient of each is the
collective that carries gradients back), and the sparse allreduce."""
from __future__ import annotations

import torch

from . import ops as _ops
from .calls import Average, Sum
from .handles import synchronize
from .process_sets import global_process_set


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _compressed(tensor, compression, differentiable, start) -> torch.Tensor:
    """``tensor`` compressed, through one collective and decompressed: ``differentiable(t)``
    (an autograd Function's apply) when a gradient must flow back, else ``start(t)``'s handle,
    waited on."""
    from .compression import Compression
    compression = compression or Compression.none
    t, ctx = compression.compress(tensor)
    out = differentiable(t) if _needs_grad(t) else synchronize(start(t))
    return compression.decompress(out, ctx)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, process_set, name):
        ctx.args = (op, prescale, postscale, process_set)
        return synchronize(_ops.allreduce_async(tensor, None, name, op, prescale, postscale,
                                                process_set))

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, ps = ctx.args
        return (synchronize(_ops.allreduce_async(grad, None, None, op, prescale, postscale, ps)),
                None, None, None, None, None)


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """The reduction of ``tensor`` over the ranks (a new tensor; differentiable)."""
    code = _ops.resolve_op("allreduce", average, op)
    return _compressed(
        tensor, compression,
        lambda t: _Allreduce.apply(t, code, prescale_factor, postscale_factor, process_set, name),
        lambda t: _ops.allreduce_async(t, None, name, code, prescale_factor, postscale_factor,
                                       process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, prescale, postscale, process_set, name, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(synchronize(_ops.grouped_allreduce_async(
            list(tensors), None, name, op, prescale, postscale, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, ps = ctx.args
        out = synchronize(_ops.grouped_allreduce_async(list(grads), None, None, op, prescale,
                                                       postscale, ps))
        return (None, None, None, None, None, *out)


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> list[torch.Tensor]:
    from .compression import Compression
    code = _ops.resolve_op("grouped_allreduce", average, op)
    compression = compression or Compression.none
    packed = [compression.compress(t) for t in tensors]
    ts = [p[0] for p in packed]
    if _needs_grad(*ts):
        outs = _GroupedAllreduce.apply(code, prescale_factor, postscale_factor, process_set,
                                       name, *ts)
    else:
        outs = synchronize(_ops.grouped_allreduce_async(ts, None, name, code, prescale_factor,
                                                        postscale_factor, process_set))
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, packed)]


def _my_rows(grad: torch.Tensor, process_set, rows: int) -> torch.Tensor:
    """This rank's slice of an allgathered gradient (gathered sizes first)."""
    sizes = synchronize(_ops.allgather_async(torch.tensor([rows]), None, process_set))
    r = process_set._comm.rank
    start = int(sizes[:r].sum())
    return grad[start:start + rows]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.ps, ctx.rows = process_set, tensor.shape[0] if tensor.dim() else 1
        return synchronize(_ops.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = synchronize(_ops.allreduce_async(grad, None, None, Average, 1.0, 1.0, ctx.ps))
        return _my_rows(reduced, ctx.ps, ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ)."""
    if _needs_grad(tensor):
        return _Allgather.apply(tensor, name, process_set)
    return synchronize(_ops.allgather_async(tensor, name, process_set))


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.ps, ctx.rows = process_set, [t.shape[0] if t.dim() else 1 for t in tensors]
        return tuple(synchronize(_ops.grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        reduced = synchronize(_ops.grouped_allreduce_async(list(grads), None, None, Average, 1.0,
                                                           1.0, ctx.ps))
        return (None, None, *[_my_rows(g, ctx.ps, n) for g, n in zip(reduced, ctx.rows)])


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list[torch.Tensor]:
    if _needs_grad(*tensors):
        return list(_GroupedAllgather.apply(name, process_set, *tensors))
    return synchronize(_ops.grouped_allgather_async(list(tensors), name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.ps = root_rank, process_set
        return synchronize(_ops.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = synchronize(_ops.allreduce_async(grad, None, None, Average, 1.0, 1.0, ctx.ps))
        from .basics import rank
        if rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Rank ``root_rank``'s ``tensor`` on every rank (a new tensor; differentiable)."""
    if _needs_grad(tensor):
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return synchronize(_ops.broadcast_async(tensor, root_rank, name, process_set))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, recv = synchronize(_ops.alltoall_async(tensor, splits, name, process_set))
        ctx.ps, ctx.recv = process_set, recv
        ctx.mark_non_differentiable(recv)
        return out, recv

    @staticmethod
    def backward(ctx, grad, _unused):
        back, _ = synchronize(_ops.alltoall_async(grad.contiguous(), ctx.recv.cpu(), None, ctx.ps))
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rank r's ``splits[j]`` rows go to rank j; returns (received, received splits) when
    ``splits`` is given, else the received tensor (equal splits)."""
    n = process_set._live("alltoall").size
    given = splits is not None
    sp = splits if given else None
    if _needs_grad(tensor):
        if sp is None:
            if tensor.dim() == 0 or tensor.shape[0] % n:
                synchronize(_ops.alltoall_async(tensor, None, name, process_set))  # raises
            sp = torch.full((n,), tensor.shape[0] // n, dtype=torch.int32)
        out, recv = _Alltoall.apply(tensor, sp, name, process_set)
        if given and isinstance(splits, torch.Tensor):
            recv = recv.to(splits.device)
        return (out, recv) if given else out
    return synchronize(_ops.alltoall_async(tensor, splits, name, process_set))


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, name, process_set):
        ctx.op, ctx.ps, ctx.scale = op, process_set, prescale * postscale
        return synchronize(_ops.reducescatter_async(tensor, name, op, process_set, prescale,
                                                    postscale))

    @staticmethod
    def backward(ctx, grad):
        full = synchronize(_ops.allgather_async(grad.contiguous(), None, ctx.ps))
        if ctx.op == Sum:
            full = full * ctx.ps._comm.size
        return full * ctx.scale if ctx.scale != 1.0 else full, None, None, None, None, None


def reducescatter(tensor, name=None, compression=None, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0) -> torch.Tensor:
    """The reduction over the ranks, rank r keeping its share of the first dimension."""
    return _compressed(
        tensor, compression,
        lambda t: _Reducescatter.apply(t, op, prescale_factor, postscale_factor, name, process_set),
        lambda t: _ops.reducescatter_async(t, name, op, process_set, prescale_factor,
                                           postscale_factor))


def grouped_reducescatter(tensors, name=None, compression=None, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> list[torch.Tensor]:
    if _needs_grad(*tensors):
        return [reducescatter(t, None if name is None else f"{name}.{i}", compression, op,
                              process_set, prescale_factor, postscale_factor)
                for i, t in enumerate(tensors)]
    from .compression import Compression
    compression = compression or Compression.none
    packed = [compression.compress(t) for t in tensors]
    outs = synchronize(_ops.grouped_reducescatter_async([p[0] for p in packed], name, op,
                                                        process_set, prescale_factor,
                                                        postscale_factor))
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, packed)]


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set):
    """Allreduce of a sparse COO tensor through allgathers of its indices and values; returns
    a callable giving the (coalesced, sparse) result."""
    t = tensor.coalesce()
    name_i = None if name is None else f"{name}.indices"
    name_v = None if name is None else f"{name}.values"
    hi = _ops.allgather_async(t.indices().t().contiguous(), name_i, process_set)
    hv = _ops.allgather_async(t.values().contiguous(), name_v, process_set)
    n = process_set._live("sparse_allreduce_async").size

    def result():
        idx = synchronize(hi).t()
        vals = synchronize(hv)
        if op == Average:
            vals = vals / n
        elif op != Sum:
            raise ValueError("sparse_allreduce_async: op must be hvd.Average or hvd.Sum")
        return torch.sparse_coo_tensor(idx, vals, t.shape).coalesce()

    return result
