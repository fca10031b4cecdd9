"""DeepSpeed's compression backends on the ``Compressor``: ``MpiBackend`` and ``CompressedBackend``.

A "backend" in DeepSpeed's sense (``runtime/comm/mpi.py``, ``compressed.py``): an object with
``compressed_allreduce(buffer_m, worker_error, server_error, local_rank)``, not a
torch.distributed backend. Both are thin: DeepSpeed's arguments and in-place contract on top of
``compressor.Compressor``, which holds the algorithm's buffers, workspaces and decisions.
"""
from __future__ import annotations

from typing import Any

import torch

from .compressor import Compressor
from .transport import GroupTransport

__all__ = ["MpiBackend", "CompressedBackend"]


def _is_cupy(x: Any) -> bool:
    return hasattr(x, "__cuda_array_interface__") and type(x).__module__.startswith("cupy")


class MpiBackend(Compressor):
    """1-bit compressed allreduce with worker and server error feedback (DeepSpeed's MpiBackend).

    ``comm`` is anything ``mpicomm.as_communicator`` takes. ``cuda_aware`` is accepted for
    DeepSpeed compatibility only: whether device buffers go straight to MPI is mpicomm's device
    policy. ``kernels`` and ``hierarchical`` are the ``Compressor``'s (so are ``calls``,
    ``wire_bytes``, ``compressed_reduce_scatter`` and ``allreduce_into``).
    """

    def __init__(self, cuda_aware: bool = False, comm: Any = None, *, kernels: str | None = None,
                 hierarchical: bool | None = None) -> None:
        super().__init__(comm, kernels=kernels, hierarchical=hierarchical)
        self.cuda_aware = bool(cuda_aware)

    def compressed_allreduce(self, buffer_m, worker_error, server_error, local_rank: int = 0):
        """Overwrite ``buffer_m`` with the compressed mean of every rank's ``buffer_m``; return it.

        - ``buffer_m``: torch tensor (CPU or device), numpy or cupy array, any shape, a float dtype;
          computed in float32. On success it is overwritten, whole, with the mean estimate (same
          shape and dtype) and returned (the same object).
        - ``worker_error``: contiguous float32, ``padded_size(buffer_m.numel(), world_size)``
          elements; updated in place to x - scale * sign(x), x = padded input + old error.
        - ``server_error``: contiguous float32, that size / world_size elements; updated in place.
        - ``local_rank`` is accepted for DeepSpeed compatibility and unused.

        If any rank's input is not finite, every rank raises ``NonFiniteError`` after the first
        exchange and no buffer is modified on any rank; if the ranks pass different sizes, every
        rank raises ``SizeMismatchError`` (a ``mpicomm.CollectiveMismatchError``) the same way.
        """
        if _is_cupy(buffer_m):  # zero-copy torch views; results land in the cupy arrays
            buf, we, se = (torch.from_dlpack(x) if _is_cupy(x) else x
                           for x in (buffer_m, worker_error, server_error))
            self.allreduce_into(buf, buf, we, se)
            return buffer_m
        self.allreduce_into(buffer_m, buffer_m, worker_error, server_error)
        return buffer_m


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
