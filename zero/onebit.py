"""1-bit Adam on ZeRO shards: Adam on the shard in warm-up, then a compressed momentum reduce-scatter.

Warm-up (steps 1..freeze_step): Adam exactly as ``compressed.OnebitAdam`` (= ``torch.optim.Adam``
with L2 weight decay) on the fp32 master shard, fed the averaged gradient shard.

After ``freeze_step`` the variance is frozen and gradients are no longer averaged. Each rank keeps
a local momentum over the whole model (fp32, the (world, chunk) padded layout of the shards,
started from the averaged momentum gathered once at the first frozen step) and folds its own
gradient into it. That momentum plus the rank's worker error is sent as signs and one scale
(phase 1 of the 1-bit allreduce alone, ``compressed.MpiBackend.compressed_reduce_scatter``:
packed signs sent to each chunk's owner,
error feedback kept by the sender); the owner averages the decoded chunks in fp32 and updates
its shard. Since the mean of the local momenta is the momentum of the averaged gradient, the
owner follows 1-bit Adam's update with a bounded compression error; no fp32 gradient or momentum
travels, only the weights' all-gather that ZeRO always does.
"""
from __future__ import annotations

from typing import Any

import torch

from .partition import ceil_div


class ShardedOnebitAdam(torch.optim.Optimizer):
    """The wrapped optimizer of ``ZeroOptimizer(compressed.OnebitAdam, ...)`` (see the module doc)."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, freeze_step: int = 100000,
                 comm: Any = None, cuda_aware: bool = False) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"OnebitAdam: expected lr, eps, weight_decay >= 0, got {lr}, {eps}, {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"OnebitAdam: expected betas in [0, 1), got {betas}")
        if freeze_step < 0:
            raise ValueError(f"OnebitAdam: expected freeze_step >= 0, got {freeze_step}")
        if comm is not None:
            raise ValueError("ZeroOptimizer(OnebitAdam, ...): pass comm= to ZeroOptimizer, not to OnebitAdam")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.freeze_step = int(freeze_step)
        self._local: dict[int, dict[str, Any]] = {}     # per group: momentum, worker error, buffers

    @property
    def global_step(self) -> int:
        """Steps taken (the ``step`` of the shard state)."""
        for g in self.param_groups:
            st = self.state.get(g["params"][0], {})
            if "step" in st:
                return int(st["step"])
        return 0

    @property
    def frozen(self) -> bool:
        """Whether the next step uses compressed momentum."""
        return self.global_step >= self.freeze_step

    def _state(self, m: torch.Tensor) -> dict[str, Any]:
        st = self.state[m]
        if not st:
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(m)
            st["exp_avg_sq"] = torch.zeros_like(m)
        return st

    def _update(self, group: dict, m: torch.Tensor, st: dict, t: int) -> None:
        beta1, beta2 = group["betas"]
        bc1 = 1 - beta1 ** t
        bc2 = 1 - beta2 ** min(t, self.freeze_step) if self.freeze_step > 0 else 1.0
        denom = (st["exp_avg_sq"].sqrt() / (bc2 ** 0.5 if bc2 > 0 else 1.0)).add_(group["eps"])
        m.addcdiv_(st["exp_avg"], denom, value=-group["lr"] / bc1)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Warm-up step: Adam on each master shard with its averaged gradient ``grad``."""
        if self.frozen:
            raise RuntimeError("ShardedOnebitAdam: after freeze_step the ZeroOptimizer calls frozen_step()")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for m in group["params"]:
                g = m.grad if m.grad is not None else torch.zeros_like(m)
                st = self._state(m)
                if group["weight_decay"]:
                    g = g.add(m, alpha=group["weight_decay"])
                st["exp_avg"].lerp_(g, 1 - beta1)
                st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                st["step"] += 1
                self._update(group, m, st, int(st["step"]))
        return None

    # -- frozen phase ------------------------------------------------------------------------

    def restart_local(self) -> None:
        """Drop the local momenta and errors: the next frozen step restarts them from the shards
        (or from what ``load_per_rank_state_dict`` restored)."""
        self._local.clear()

    def per_rank_state_dict(self) -> dict[str, Any]:
        """This rank's local momenta and worker errors (``ckpt.save`` stores them per rank)."""
        return {"groups": {str(gi): {"momentum": loc["mom"].clone(), "worker_error": loc["err"].clone()}
                           for gi, loc in self._local.items()}}

    def load_per_rank_state_dict(self, saved: list, rank: int, size: int) -> None:
        """Same world size: take back this rank's momenta and errors (an exact resume). Another
        size: restart every rank's momentum from the saved mean (``exp_avg``), errors at zero."""
        self._local.clear()
        self._restore = {}
        if len(saved) != size:
            return
        for gi, d in (saved[rank] or {}).get("groups", {}).items():
            self._restore[int(gi)] = (d["momentum"], d["worker_error"])

    def saved_state(self, gi: int, g: Any, comm: Any) -> dict[str, Any]:
        """The state of group ``gi``'s shard to save. After freeze_step this is collective: the
        local momenta are averaged exactly (one fp32 reduce-scatter) into ``exp_avg``, which a
        resumed run starts every rank's local momentum from (error feedback restarts at zero)."""
        st = self.state.get(g.master, {})
        loc = self._local.get(gi)
        if loc is None or g.layout.world_size == 1:
            return st
        exact = torch.empty(loc["chunk"], dtype=torch.float32, device=g.master.device)
        comm.reduce_scatter_tensor(exact, loc["mom"].view(-1), op="avg")
        L = g.layout.local_numel
        return {**st, "exp_avg": exact[:L].mul_(loc["mask"])}

    def _locals(self, gi: int, g: Any, comm: Any) -> dict[str, Any]:
        loc = self._local.get(gi)
        if loc is not None:
            return loc
        world, L = g.layout.world_size, g.layout.local_numel
        chunk = ceil_div(max(L, 1), 8) * 8
        dev = g.master.device
        saved = getattr(self, "_restore", {}).pop(gi, None)
        if saved is not None and tuple(saved[0].shape) == (world, chunk) == tuple(saved[1].shape):
            mom = saved[0].to(device=dev, dtype=torch.float32).clone()
            err = saved[1].to(device=dev, dtype=torch.float32).clone()
        else:
            full = torch.empty(world * L, dtype=torch.float32, device=dev)
            comm.all_gather_into_tensor(full, self._state(g.master)["exp_avg"])   # once per run
            mom = torch.zeros(world, chunk, dtype=torch.float32, device=dev)
            mom[:, :L].copy_(full.view(world, L))
            err = torch.zeros_like(mom)
        mask = torch.zeros(L, dtype=torch.bool, device=dev)
        for s in g.layout.segments(comm.rank):
            mask[s.local:s.local + s.length] = True
        loc = {"chunk": chunk, "mom": mom, "err": err, "grad": torch.zeros_like(mom),
               "avg": torch.empty(chunk, dtype=torch.float32, device=dev), "mask": mask}
        self._local[gi] = loc
        return loc

    @torch.no_grad()
    def frozen_step(self, groups: list, comm: Any) -> None:
        """One frozen step for every group: local momentum, compressed reduce-scatter, shard update."""
        for gi, (g, group) in enumerate(zip(groups, self.param_groups)):
            beta1 = group["betas"][0]
            loc = self._locals(gi, g, comm)
            world, L = g.layout.world_size, g.layout.local_numel
            grad = loc["grad"]
            grad.zero_()
            wd = group["weight_decay"]
            for r, s in g.layout.all_segments():
                p = g.params[s.param]
                dst = grad[r, s.local:s.local + s.length]
                if p.grad is not None:
                    dst.copy_(p.grad.detach().reshape(-1)[s.start:s.start + s.length])
                if wd:
                    dst.add_(p.detach().reshape(-1)[s.start:s.start + s.length].float(), alpha=wd)
            mom, err = loc["mom"], loc["err"]
            mom.lerp_(grad, 1 - beta1)
            if world == 1:     # nothing travels: no compression (as compressed.OnebitAllreduce)
                avg = mom[0]
            else:              # phase 1 of the 1-bit allreduce: this rank's chunk of the mean
                avg = loc["avg"]
                self._backend(comm).compressed_reduce_scatter(mom.view(-1), avg, err.view(-1))
            st = self._state(g.master)
            st["exp_avg"].copy_(avg[:L]).mul_(loc["mask"])
            st["step"] += 1
            self._update(group, g.master, st, int(st["step"]))

    def _backend(self, comm: Any) -> Any:
        if getattr(self, "_mpi_backend", None) is None or self._mpi_backend.comm is not comm:
            from compressed import MpiBackend

            self._mpi_backend = MpiBackend(comm=comm)
        return self._mpi_backend
