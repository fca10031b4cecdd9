"""OnebitAdam: Adam whose momentum is averaged with 1-bit compressed allreduce after a warm-up."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from . import adam_update as U
from .allreduce import OnebitAllreduce
from .onebit_optimizer import OnebitOptimizer
from .transport import as_comm

__all__ = ["OnebitAdam"]


class OnebitAdam(OnebitOptimizer):
    """1-bit Adam (Tang et al., as in DeepSpeed) over an mpicomm communicator.

    Steps 1..``freeze_step`` are Adam (as ``torch.optim.Adam``, weight decay added to the
    gradient) on gradients averaged over ranks with one uncompressed allreduce per step. From step
    ``freeze_step + 1`` on, the variance and its bias correction are frozen; each rank folds its
    local gradient into the momentum, and the momenta of all parameters, flattened into one
    buffer per device, are averaged with one compressed allreduce (error feedback kept by this
    optimizer). Parameters whose ``grad`` is None are skipped: every rank must skip the same ones.
    Moments are fp32 and every update is computed in fp32, also for fp16/bf16 parameters and
    gradients (rounded once into the parameter). ``state_dict()`` holds the moments and, under
    ``onebit``, the step counters (the same on every rank: warm-up and bias correction resume
    where they stopped); ``per_rank_state_dict()`` adds this rank's error feedback.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, freeze_step: int = 100000,
                 comm: Any = None, *, cuda_aware: bool = False) -> None:
        betas = U.check_adam("OnebitAdam", lr, betas, eps, weight_decay)
        freeze_step = U.check_int("OnebitAdam", "freeze_step", freeze_step, 0)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.comm = as_comm(comm)
        self.freeze_step = freeze_step
        self.global_step = 0
        self.onebit = OnebitAllreduce(self.comm, cuda_aware=cuda_aware)
        self._flats: dict[str, torch.Tensor] = {}

    def _warm_step(self, active: list, t: int) -> None:
        self._adam_step(active, t, frozen=False)

    def _frozen_step(self, active: list, t: int) -> None:
        self._adam_step(active, t, frozen=True)

    def _adam_step(self, active: list, t: int, frozen: bool) -> None:
        grads = [p.grad.detach() for _, _, p in active]
        if not frozen:
            grads = self._average(grads)
        for (_, group, p), g in zip(active, grads):
            beta1, beta2 = group["betas"]
            st = U.moments(self.state[p], p)  # fp32 whatever the parameter's dtype
            g = U.with_weight_decay(g, p, group["weight_decay"])
            st["exp_avg"].lerp_(g, 1 - beta1)
            if not frozen:
                st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if frozen:
            self._average_momenta(active)
        for _, group, p in active:
            st = self.state[p]
            U.adam_update_(p, st["exp_avg"], st["exp_avg_sq"], lr=group["lr"], betas=group["betas"],
                           eps=group["eps"], t=t, n_var=min(t, self.freeze_step))

    def _flat(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A float32 buffer kept between steps (fresh large buffers cost page faults each step)."""
        buf = self._flats.get(name)
        if buf is None or buf.numel() != numel or buf.device != like.device:
            buf = torch.empty(numel, dtype=torch.float32, device=like.device)
            self._flats[name] = buf
        return buf

    def _average(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Mean over ranks of ``tensors`` (in fp32) with one allreduce per device and dtype."""
        if self.comm.size == 1 or not tensors:
            return tensors
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for key, idx in _by_device_dtype(tensors).items():
            sizes = [tensors[i].numel() for i in idx]
            flat = self._flat(f"grad:{key[0]}:{key[1]}", sum(sizes), tensors[idx[0]])
            torch.cat([tensors[i].reshape(-1).float() for i in idx], out=flat)
            self.comm.all_reduce(flat, op="avg")
            for i, piece in zip(idx, flat.split(sizes)):
                out[i] = piece.view(tensors[i].shape)  # fp32: the update is computed in fp32
        return out  # type: ignore[return-value]

    def _average_momenta(self, active: list[tuple[int, dict, torch.Tensor]]) -> None:
        moms = [self.state[p]["exp_avg"] for _, _, p in active]
        for key, idx in _by_device_dtype(moms).items():
            sizes = [moms[i].numel() for i in idx]
            name = f"exp_avg:{key[0]}:{key[1]}"
            flat = self._flat(name, sum(sizes), moms[idx[0]])
            torch.cat([moms[i].reshape(-1).float() for i in idx], out=flat)
            self.onebit.allreduce_(flat, key=name)
            for i, piece in zip(idx, flat.split(sizes)):
                moms[i].copy_(piece.view(moms[i].shape))

    def per_rank_state_dict(self) -> dict:
        """This rank's part of a checkpoint (``ckpt``'s per-rank protocol): step counters and the
        error feedback of the compressed momentum (worker and server errors, per buffer)."""
        return {**self._counters(), "allreduce": self.onebit.per_rank_state_dict()}

    def load_per_rank_state_dict(self, saved: list[dict], rank: int, size: int) -> None:
        """Load from every saved rank's ``per_rank_state_dict()`` (rank order): exact at the same
        world size, error mass carried to another size (``compressed.reshard``)."""
        steps = {(int(s["global_step"]), int(s["freeze_step"])) for s in saved}
        if len(steps) != 1:
            raise ValueError(f"OnebitAdam.load_per_rank_state_dict: the saved ranks disagree on "
                             f"(global_step, freeze_step): {sorted(steps)}")
        self.global_step, self.freeze_step = steps.pop()
        self.onebit.load_per_rank_state_dict([s["allreduce"] for s in saved], rank, size)


def _by_device_dtype(tensors: list[torch.Tensor]) -> dict[tuple[str, str], list[int]]:
    groups: dict[tuple[str, str], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((str(t.device), str(t.dtype).replace("torch.", "")), []).append(i)
    return groups
