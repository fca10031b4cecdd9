"""1-bit Adam on ZeRO shards: Adam on the shard in warm-up, then a compressed momentum reduce-scatter.

Warm-up (steps 1..freeze_step): Adam exactly as ``compressed.OnebitAdam`` (= ``torch.optim.Adam``
with L2 weight decay) on the fp32 master shard, fed the averaged gradient shard.

After ``freeze_step`` the variance is frozen and gradients are no longer averaged. Each rank keeps
a local momentum over the whole model (fp32, the (world, chunk) padded layout of the shards,
started from the averaged momentum gathered once at the first frozen step) and folds its own
gradient into it. That momentum plus the rank's worker error is sent as signs and one scale
(phase 1 of the 1-bit allreduce alone, ``compressed.Compressor.compressed_reduce_scatter``:
packed signs sent to each chunk's owner,
error feedback kept by the sender); the owner averages the decoded chunks in fp32 and updates
its shard. Since the mean of the local momenta is the momentum of the averaged gradient, the
owner follows 1-bit Adam's update with a bounded compression error; no fp32 gradient or momentum
travels, only the weights' all-gather that ZeRO always does.
"""
from __future__ import annotations

from typing import Any

import torch

from compressed import Compressor
from compressed import adam_update as U

from .partition import ceil_div


class ShardedOnebitAdam(torch.optim.Optimizer):
    """The wrapped optimizer of ``ZeroOptimizer(compressed.OnebitAdam, ...)`` (see the module doc)."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, freeze_step: int = 100000,
                 comm: Any = None, cuda_aware: bool = False) -> None:
        betas = U.check_adam("OnebitAdam", lr, betas, eps, weight_decay)
        freeze_step = U.check_int("OnebitAdam", "freeze_step", freeze_step, 0)
        if comm is not None:
            raise ValueError("ZeroOptimizer(OnebitAdam, ...): pass comm= to ZeroOptimizer, not to OnebitAdam")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.freeze_step = freeze_step
        self.global_step = 0    # steps taken; the shard states carry it as "step" in checkpoints
        self._local: dict[int, dict[str, Any]] = {}     # per group: momentum, worker error, buffers
        self._compressor_on: Compressor | None = None   # phase 1 of the 1-bit allreduce, on comm

    @property
    def frozen(self) -> bool:
        """Whether the next step uses compressed momentum."""
        return self.global_step >= self.freeze_step

    def _state(self, m: torch.Tensor) -> dict[str, Any]:
        return U.moments(self.state[m], m)

    def _update(self, group: dict, m: torch.Tensor, st: dict, t: int) -> None:
        U.adam_update_(m, st["exp_avg"], st["exp_avg_sq"], lr=group["lr"], betas=group["betas"],
                       eps=group["eps"], t=t, n_var=min(t, self.freeze_step))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Warm-up step: Adam on each master shard with its averaged gradient ``grad``."""
        if self.frozen:
            raise RuntimeError("ShardedOnebitAdam: after freeze_step the ZeroOptimizer calls frozen_step()")
        t = self.global_step + 1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for m in group["params"]:
                g = m.grad if m.grad is not None else torch.zeros_like(m)
                st = self._state(m)
                g = U.with_weight_decay(g, m, group["weight_decay"])
                st["exp_avg"].lerp_(g, 1 - beta1)
                st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                self._update(group, m, st, t)
        self.global_step = t
        return None

    # -- frozen phase ------------------------------------------------------------------------

    def restart_local(self) -> None:
        """After ``ZeroOptimizer.set_shard_state``: take ``global_step`` back from the shard
        states (their "step", the checkpoint's form of it) and drop the local momenta and errors:
        the next frozen step restarts them from the shards (or from what
        ``load_per_rank_state_dict`` restored)."""
        for g in self.param_groups:
            st = self.state.get(g["params"][0])
            if st and "step" in st:
                self.global_step = int(st.pop("step"))
        self._local.clear()

    def rebound(self) -> None:
        """After ``ZeroOptimizer.rebind`` (the survivors of a failure): ``global_step`` from the
        shard states' "step" (0 without one: no step was committed), the local momenta and worker
        errors dropped. Exact where the state was taken by ``saved_state`` (as elastic commits
        it): ``exp_avg`` is then the mean of every old rank's local momentum, which the next
        frozen step restarts each survivor's from; the error feedback restarts at zero, as on a
        checkpoint load at another world size (DeepSpeed resets it on a reload too)."""
        steps = {int(st.pop("step")) for g in self.param_groups
                 if (st := self.state.get(g["params"][0])) and "step" in st}
        if len(steps) > 1:
            raise ValueError(f"ShardedOnebitAdam.rebound: the groups' step counts differ: {sorted(steps)}")
        self.global_step = steps.pop() if steps else 0
        self._local.clear()
        self._restore = {}

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
        if st:
            st = {**st, "step": torch.tensor(float(self.global_step))}
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
        t = self.global_step + 1
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
                self._compressor(comm).compressed_reduce_scatter(mom.view(-1), avg, err.view(-1))
            st = self._state(g.master)
            st["exp_avg"].copy_(avg[:L]).mul_(loc["mask"])
            self._update(group, g.master, st, t)
        self.global_step = t

    def _compressor(self, comm: Any) -> Compressor:
        if self._compressor_on is None or self._compressor_on.comm is not comm:
            self._compressor_on = Compressor(comm)
        return self._compressor_on
