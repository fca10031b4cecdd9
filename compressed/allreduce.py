"""OnebitAllreduce: a compressed mean over ranks that owns its error-feedback buffers by name."""
from __future__ import annotations

from typing import Any

import torch

from .backend import MpiBackend, as_communicator
from .layout import padded_size

__all__ = ["OnebitAllreduce"]


class OnebitAllreduce:
    """Callable returning the 1-bit compressed mean of a tensor over the communicator's ranks.

    ``ar(tensor, key="name")`` returns a new tensor (same shape, dtype and device) holding the
    mean estimate; ``tensor`` is not modified. Each ``key`` has its own worker and server error
    buffers (float32, created on first use on the tensor's device); a key must keep its size.
    World size 1 returns an unchanged copy (nothing to compress); empty tensors are returned as
    empty copies without communicating. Half and bfloat16 (and float64) inputs are computed in
    float32 and returned in their dtype. A non-finite input on any rank raises
    ``NonFiniteError`` on every rank, leaving the error buffers as they were.
    """

    def __init__(self, comm: Any = None, *, cuda_aware: bool = False,
                 kernels: str | None = None) -> None:
        self.comm = as_communicator(comm)
        self.backend = MpiBackend(cuda_aware=cuda_aware, comm=self.comm, kernels=kernels)
        self.size = self.comm.size
        self._errors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, tensor: torch.Tensor, key: str = "default") -> torch.Tensor:
        """Return the compressed mean of ``tensor`` over ranks, using the error buffers of ``key``."""
        self._check(tensor)
        if self.size == 1 or tensor.numel() == 0:
            return tensor.detach().clone()
        we, se = self.errors(key, tensor.numel(), tensor.device)
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        self.backend.allreduce_into(tensor.detach(), out, we, se)
        return out

    def allreduce_(self, tensor: torch.Tensor, key: str = "default") -> torch.Tensor:
        """In-place variant: overwrite ``tensor`` with the compressed mean and return it."""
        self._check(tensor)
        if self.size == 1 or tensor.numel() == 0:
            return tensor
        we, se = self.errors(key, tensor.numel(), tensor.device)
        self.backend.allreduce_into(tensor.detach(), tensor.detach(), we, se)
        return tensor

    @staticmethod
    def _check(tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"OnebitAllreduce: expected a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"OnebitAllreduce: expected a floating tensor, got dtype {tensor.dtype}")

    def errors(self, key: str, numel: int | None = None,
               device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The (worker_error, server_error) of ``key``; created as zeros when ``numel`` is given."""
        pair = self._errors.get(key)
        if pair is None:
            if numel is None:
                raise KeyError(f"OnebitAllreduce: no error buffers for key {key!r}")
            n = padded_size(numel, self.size)
            pair = (torch.zeros(n, dtype=torch.float32, device=device),
                    torch.zeros(n // self.size, dtype=torch.float32, device=device))
            self._errors[key] = pair
        elif numel is not None and pair[0].numel() != padded_size(numel, self.size):
            raise ValueError(f"OnebitAllreduce: key {key!r} holds error buffers for "
                             f"{pair[0].numel()} padded elements, got a tensor of {numel} elements "
                             f"(padded {padded_size(numel, self.size)}); use another key or reset()")
        return pair

    def keys(self) -> list[str]:
        """Names that own error buffers."""
        return list(self._errors)

    def reset(self, key: str | None = None) -> None:
        """Drop the error buffers of ``key`` (all keys when None)."""
        if key is None:
            self._errors.clear()
        else:
            self._errors.pop(key, None)

    def state_dict(self) -> dict:
        """Error buffers by key (this rank's; they differ between ranks)."""
        return {"world_size": self.size,
                "errors": {k: {"worker_error": we.clone(), "server_error": se.clone()}
                           for k, (we, se) in self._errors.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore error buffers saved by ``state_dict`` at the same world size."""
        if int(state.get("world_size", -1)) != self.size:
            raise ValueError(f"OnebitAllreduce.load_state_dict: saved at world size "
                             f"{state.get('world_size')}, loading at {self.size}")
        errors = {}
        for k, d in state["errors"].items():
            errors[k] = (d["worker_error"].detach().to(torch.float32).clone().contiguous(),
                         d["server_error"].detach().to(torch.float32).clone().contiguous())
        self._errors = errors
