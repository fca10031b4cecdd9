"""A DistributedDataParallel comm hook that averages gradient buckets with 1-bit compression."""
# No ``from __future__ import annotations``: DDP compares the hook's annotations with the real
# classes (dist.GradBucket, torch.futures.Future[torch.Tensor]).
from typing import Any

import torch
import torch.distributed as dist

from .allreduce import OnebitAllreduce
from .transport import as_comm

__all__ = ["OnebitDDPState", "onebit_ddp_hook"]


class OnebitDDPState:
    """State of ``onebit_ddp_hook``: the communicator, error buffers, the step counter.

    The first ``warmup_steps`` steps, and every bucket under ``min_bucket_numel`` elements, are
    averaged uncompressed (mpicomm all_reduce); the rest with 1-bit compressed allreduce, one
    pair of error buffers per bucket. ``comm`` is an mpicomm Communicator (what
    ``mpicomm.as_communicator`` takes; None: the world) or a torch.distributed process group
    (``compressed.transport``), whatever process group DDP itself was built on.
    ``hierarchical`` as ``OnebitAllreduce``'s (None: hierarchical when there are several nodes
    with the same number > 1 of ranks each; False: flat).
    """

    def __init__(self, comm: Any = None, warmup_steps: int = 100, min_bucket_numel: int = 1 << 16,
                 *, cuda_aware: bool = False, hierarchical: bool | None = None) -> None:
        if warmup_steps < 0 or min_bucket_numel < 0:
            raise ValueError(f"OnebitDDPState: expected warmup_steps >= 0 and min_bucket_numel >= 0, "
                             f"got {warmup_steps} and {min_bucket_numel}")
        self.comm = as_comm(comm)  # a Communicator or a process group (GroupTransport)
        self.warmup_steps = int(warmup_steps)
        self.min_bucket_numel = int(min_bucket_numel)
        self.allreduce = OnebitAllreduce(self.comm, cuda_aware=cuda_aware, hierarchical=hierarchical)
        self.step = 0
        self.compressed_buckets = 0
        self.uncompressed_buckets = 0

    def state_dict(self) -> dict:
        """The step counter and this rank's error buffers (same world size: ``load_state_dict``)."""
        return {"step": self.step, "allreduce": self.allreduce.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s output saved at the same world size."""
        self.step = int(state["step"])
        self.allreduce.load_state_dict(state["allreduce"])

    def per_rank_state_dict(self) -> dict:
        """This rank's part of a checkpoint (``ckpt``'s per-rank protocol): ``state_dict()``."""
        return self.state_dict()

    def load_per_rank_state_dict(self, saved: list[dict], rank: int, size: int) -> None:
        """Load from every saved rank's state (rank order): exact at the same world size, error
        mass carried to another size (``compressed.reshard``)."""
        steps = {int(s["step"]) for s in saved}
        if len(steps) != 1:
            raise ValueError(f"OnebitDDPState.load_per_rank_state_dict: the saved ranks disagree on "
                             f"the step: {sorted(steps)}")
        self.step = steps.pop()
        self.allreduce.load_per_rank_state_dict([s["allreduce"] for s in saved], rank, size)


def onebit_ddp_hook(state: OnebitDDPState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: return a future holding the mean of this gradient bucket over ranks."""
    buf = bucket.buffer()
    if state.step < state.warmup_steps or buf.numel() < state.min_bucket_numel:
        if state.comm.size > 1:
            state.comm.all_reduce(buf, op="avg")
        result = buf
        state.uncompressed_buckets += 1
    else:
        result = state.allreduce(buf, key=f"bucket{bucket.index()}:{buf.numel()}")
        state.compressed_buckets += 1
    if bucket.is_last():
        state.step += 1
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(result)
    return fut
