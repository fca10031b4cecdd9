"""``allreduce_ddp_hook``: a DDP comm hook that averages gradient buckets through mpicomm on any
process group (named as ``compressed.onebit_ddp_hook``: the reduction, then ``_ddp_hook``)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import progress_thread
from ..communicator import Communicator, init
from ..ops import ReduceOp


def allreduce_ddp_hook(state, bucket: "dist.GradBucket") -> torch.futures.Future:
    """DDP comm hook: average the gradient bucket across ranks through mpicomm.

    ``state`` is the Communicator to use (None: the world communicator). The all-reduce runs
    non-blocking (completed by mpicomm's progress thread) under MPI_THREAD_MULTIPLE.
    """
    comm = state if isinstance(state, Communicator) else init()
    buf = bucket.buffer()
    if progress_thread.enabled():
        work = comm.all_reduce(buf, op=ReduceOp.AVG, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    comm.all_reduce(buf, op=ReduceOp.AVG)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


# DDP inspects the hook's annotations as objects, not the strings that postponed evaluation makes.
allreduce_ddp_hook.__annotations__["bucket"] = dist.GradBucket
allreduce_ddp_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
