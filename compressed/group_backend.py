"""CompressedBackend: DeepSpeed's 1-bit compressed allreduce over any torch.distributed process group."""
from __future__ import annotations

from typing import Any

from .deepspeed_backend import MpiBackend
from .transport import GroupTransport

__all__ = ["CompressedBackend"]


class CompressedBackend(MpiBackend):
    """``MpiBackend`` on a torch.distributed process group (``group=None``: the default group).

    ``compressed_allreduce(buffer_m, worker_error, server_error, local_rank)`` has DeepSpeed's
    signature and runs the same engine and wire format as ``MpiBackend``, its two phases on the
    group's ``all_to_all_single`` and ``all_gather_into_tensor``: the mpicomm backend, gloo (CPU
    tensors) or NCCL (CUDA tensors). On the same inputs results and errors equal ``MpiBackend``'s.
    """

    def __init__(self, group: Any = None, *, kernels: str | None = None) -> None:
        super().__init__(comm=GroupTransport(group), kernels=kernels)
        self.group = group
