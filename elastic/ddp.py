"""A DDP comm hook for training under elastic (a workaround, see below).

Workaround: DDP's built-in all-reduce path (no comm hook) crashes the process (a segmentation
fault in torch's ``parseCppCommHookResult``, torch 2.13) when the mpicomm process group's
all-reduce future fails, as it does when a rank died; a Python comm hook gets the failure as an
exception instead. Register this hook on every DDP built under ``elastic.run`` until the
process group's futures fail in a way torch's built-in path accepts:

    ddp = DDP(model); ddp.register_comm_hook(None, elastic.allreduce_hook)
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def allreduce_hook(state: object, bucket: "dist.GradBucket") -> torch.futures.Future:
    """Average the gradient bucket over torch's default process group (``state`` unused)."""
    t = bucket.buffer()
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP inspects the hook's annotations as objects, not the strings postponed evaluation makes
allreduce_hook.__annotations__["bucket"] = dist.GradBucket
allreduce_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
