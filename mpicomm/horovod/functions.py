"""Broadcasting a model's parameters and an optimizer's state, and Python objects
(``broadcast_object`` / ``allgather_object``: pickled in memory, sent between the job's ranks,
never written to a file)."""
from __future__ import annotations

import io
import pickle

import torch

from . import ops as _ops
from .handles import synchronize
from .process_sets import global_process_set


def broadcast_parameters(params, root_rank: int = 0, process_set=global_process_set) -> None:
    """Copy rank ``root_rank``'s values into ``params`` on every rank: a ``state_dict()``, or
    ``named_parameters()`` (an iterable of (name, tensor))."""
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        try:
            items = list(params)
        except TypeError:
            items = None
        if items is None or any(not (isinstance(i, tuple) and len(i) == 2) for i in items):
            raise ValueError("broadcast_parameters: expected a dict (model.state_dict()) or an "
                             "iterable of (name, tensor) pairs (model.named_parameters())")
    handles = []
    for name, p in items:
        if p is None or not isinstance(p, torch.Tensor):
            continue
        t = p.data if isinstance(p, torch.nn.Parameter) or p.requires_grad else p
        handles.append(_ops.broadcast_async_(t, root_rank, None, process_set))
    for h in handles:
        synchronize(h)


def broadcast_object(obj=None, root_rank: int = 0, name: str | None = None,
                     process_set=global_process_set):
    """Rank ``root_rank``'s ``obj`` on every rank (pickled in memory for the trip)."""
    process_set._live("broadcast_object")
    me = _world_rank()
    if me == root_rank:
        buf = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([buf.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    synchronize(_ops.broadcast_async_(size, root_rank, None, process_set))
    if me != root_rank:
        buf = torch.empty(int(size[0]), dtype=torch.uint8)
    synchronize(_ops.broadcast_async_(buf, root_rank, None, process_set))
    return obj if me == root_rank else _loads(buf)


def allgather_object(obj, name: str | None = None, process_set=global_process_set) -> list:
    """Every rank's ``obj``, in rank order."""
    buf = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
    sizes = synchronize(_ops.allgather_async(torch.tensor([buf.numel()]), None, process_set))
    data = synchronize(_ops.allgather_async(buf, None, process_set))
    out, at = [], 0
    for n in sizes.tolist():
        out.append(_loads(data[at:at + n]))
        at += n
    return out


def _world_rank() -> int:
    from .basics import rank
    return rank()


def _dumps(obj) -> bytes:
    b = io.BytesIO()
    pickle.dump(obj, b)
    return b.getvalue() or b"\x80\x04N."


def _loads(t: torch.Tensor):
    return pickle.loads(t.numpy().tobytes())


_TENSOR = "__mpicomm_horovod_tensor__"


def _is_marker(x) -> bool:
    """Whether ``x`` is the (_TENSOR, index, shape, dtype) that stands for a tensor."""
    return isinstance(x, tuple) and len(x) == 4 and x[0] == _TENSOR


def _rebuild(x, leaf):
    """``x`` with its dicts, lists and tuples rebuilt around ``leaf(v)`` for every other value
    ``v`` in them (a tensor marker counts as a value)."""
    if isinstance(x, dict):
        return {k: _rebuild(v, leaf) for k, v in x.items()}
    if isinstance(x, list):
        return [_rebuild(v, leaf) for v in x]
    if isinstance(x, tuple) and not _is_marker(x):
        return tuple(_rebuild(v, leaf) for v in x)
    return leaf(x)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model=None, process_set=global_process_set) -> None:
    """Make every rank's optimizer state and options (lr, momentum, ...) rank ``root_rank``'s."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("broadcast_optimizer_state: cannot broadcast torch.optim.LBFGS state")
    process_set._live("broadcast_optimizer_state")
    me = _world_rank()
    sd = optimizer.state_dict() if me == root_rank else None
    tensors: list[torch.Tensor] = []

    def strip(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return (_TENSOR, len(tensors) - 1, list(x.shape), str(x.dtype).replace("torch.", ""))
        return x

    skeleton = broadcast_object(_rebuild(sd, strip) if me == root_rank else None, root_rank,
                                process_set=process_set)
    if not skeleton["state"]:
        # nothing to copy yet: give each trainable parameter a zero gradient, as Horovod does
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    received: list[torch.Tensor] = []

    def fill(x):
        if _is_marker(x):
            if me == root_rank:
                t = tensors[x[1]].detach().cpu().clone(memory_format=torch.contiguous_format)
            else:
                t = torch.empty(x[2], dtype=getattr(torch, x[3]))
            received.append(t)
            return t
        return x

    full = _rebuild(skeleton, fill)
    handles = [_ops.broadcast_async_(t, root_rank, None, process_set) for t in received]
    for h in handles:
        synchronize(h)
    if me != root_rank:
        optimizer.load_state_dict(full)
