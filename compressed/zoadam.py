"""ZeroOneAdam: 0/1 Adam (Lu et al., arXiv 2202.06009, as in DeepSpeed) on the 1-bit engine."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from . import adam_update as U
from .allreduce import OnebitAllreduce
from .errors import NonFiniteError
from .flat import mean_compressed, mean_exact
from .onebit_optimizer import OnebitOptimizer
from .transport import as_comm

__all__ = ["ZeroOneAdam"]

_COUNTERS = ("global_step", "var_freeze_step", "var_interval", "var_counter", "var_updates",
             "local_step_interval", "local_step_counter", "lrs")


class ZeroOneAdam(OnebitOptimizer):
    """0/1 Adam over an mpicomm communicator or a torch.distributed process group (``comm``).

    Step ``t`` (from 1), while ``t <= var_freeze_step``:

    - a *variance step* when ``t`` is a multiple of ``var_interval``: gradients averaged exactly
      (one allreduce), both moments updated. The interval starts at 1 and doubles after every
      ``var_update_scaler`` variance steps;
    - otherwise the gradients are averaged by one 1-bit compressed allreduce (error feedback kept
      here) and only the momentum takes them; the variance stays.

    Then the variance is frozen and the ranks take *local steps* on their own gradients; every
    ``local_step_interval`` steps one compressed allreduce averages the update accumulated since
    the last sync (``sum lr_k m_k``), each rank replaces its local steps by the averaged one, and
    the momentum restarts from the average (``- sum / sum lr_k``). The interval starts at 1 and
    doubles every ``local_step_scaler`` frozen steps, up to ``local_step_clipper``. Inside an
    interval each rank keeps an fp32 copy of the weights of the last sync beside the accumulated
    update (two model-sized buffers): a sync writes ``sync weights + averaged update``, so the
    ranks' weights are bitwise equal after every sync (undoing the local steps by subtraction,
    as DeepSpeed does, leaves rank-dependent rounding).

    The update itself is the 1-bit Adam family's (``compressed.adam_update``: bias-corrected, L2
    weight decay in the gradient, moments fp32), so before any compression this is
    ``torch.optim.Adam`` on averaged gradients. Unlike DeepSpeed there is no no-op
    "initialisation" first step, the variance's bias correction counts its updates, and the
    gradients of all parameters go in one compressed allreduce per device (not one per tensor).

    A non-finite gradient during a local step is not applied; every rank raises
    ``NonFiniteError`` at the next sync (the first exchange that can tell them), changing
    nothing there. ``last_round`` says what the last step sent: "exact", "compressed", "local"
    (nothing) or "sync". ``state_dict()`` holds the moments and counters; ``per_rank_state_dict()``
    adds this rank's error feedback and, inside a local interval, its local weights, momentum,
    accumulated update and the weights of the last sync.
    """

    COUNTERS_KEY = "zero_one"   # the step counters and intervals

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, var_freeze_step: int = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678,
                 local_step_clipper: int = 16, comm: Any = None, *, cuda_aware: bool = False) -> None:
        name = type(self).__name__
        betas = U.check_adam(name, lr, betas, eps, weight_decay)
        self.var_freeze_step = U.check_int(name, "var_freeze_step", var_freeze_step, 0)
        self.var_update_scaler = U.check_int(name, "var_update_scaler", var_update_scaler, 1)
        self.local_step_scaler = U.check_int(name, "local_step_scaler", local_step_scaler, 1)
        self.local_step_clipper = U.check_int(name, "local_step_clipper", local_step_clipper, 1)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.comm = as_comm(comm)
        self.onebit = OnebitAllreduce(self.comm, cuda_aware=cuda_aware)
        self.global_step = 0
        self.var_interval, self.var_counter, self.var_updates = 1, 0, 0
        self.local_step_interval, self.local_step_counter = 1, 0
        self.lrs = [0.0] * len(self.param_groups)      # per group: sum of step sizes since the sync
        self.last_round: str | None = None
        self._acc: dict[torch.Tensor, torch.Tensor] = {}  # local accumulated update, per parameter
        self._base: dict[torch.Tensor, torch.Tensor] = {}  # fp32 weights of the last sync
        self._poisoned = False

    @property
    def frozen(self) -> bool:
        """Whether the next step is after ``var_freeze_step`` (local steps and syncs)."""
        return self.global_step >= self.var_freeze_step

    def _warm_step(self, active: list, t: int) -> None:
        var_step = t % self.var_interval == 0
        grads = [U.with_weight_decay(p.grad, p, g["weight_decay"]) for _, g, p in active]
        if var_step:
            grads = mean_exact(self.comm, grads)
        else:  # raises NonFiniteError everywhere before anything changes
            grads = mean_compressed(self.onebit, grads, "grad")
        for (_, group, p), g in zip(active, grads):
            beta1, beta2 = group["betas"]
            st = U.moments(self.state[p], p)
            st["exp_avg"].lerp_(g, 1 - beta1)
            if var_step:
                st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if var_step:
            self.var_updates += 1
        for _, group, p in active:
            st = self.state[p]
            U.adam_update_(p, st["exp_avg"], st["exp_avg_sq"], lr=group["lr"], betas=group["betas"],
                           eps=group["eps"], t=t, n_var=self.var_updates)
        if var_step:
            self.var_counter += 1
            if self.var_counter == self.var_update_scaler:
                self.var_counter = 0
                self.var_interval *= 2
        self.last_round = "exact" if var_step else "compressed"

    def _frozen_step(self, active: list, t: int) -> None:
        for key in self.onebit.keys():   # the gradient's errors mean nothing for the updates
            if key.startswith("grad:"):
                self.onebit.reset(key)
        grads = [U.with_weight_decay(p.grad, p, g["weight_decay"]) for _, g, p in active]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if not finite:
            self._poisoned = True   # not applied; every rank learns it at the sync
        lrs = list(self.lrs)
        if finite:
            for gi in sorted({gi for gi, _, _ in active}):
                lrs[gi] += U.step_size(self.param_groups[gi]["lr"], self.param_groups[gi]["betas"][0], t)
        if t % self.local_step_interval == 0:
            self._sync(self._plan(active, grads, t, finite), lrs)
        else:                       # a local step: nothing sent, nothing can fail: in place
            for (gi, group, p), g in zip(active, grads):
                if not finite:
                    break
                beta1, beta2 = group["betas"]
                st = U.moments(self.state[p], p)
                if p not in self._base:
                    self._base[p] = p.detach().float().clone()
                acc = self._acc.get(p)
                if acc is None:
                    acc = self._acc[p] = torch.zeros_like(st["exp_avg"])
                st["exp_avg"].lerp_(g, 1 - beta1)
                den = U.denom(st["exp_avg_sq"], beta2, self.var_updates, group["eps"])
                step = U.step_size(group["lr"], beta1, t)
                acc.addcdiv_(st["exp_avg"], den, value=-step)
                U.apply_(p, st["exp_avg"], den, step)
            self.lrs = lrs
            self.last_round = "local"
        self.local_step_counter += 1
        if self.local_step_counter == self.local_step_scaler:
            self.local_step_counter = 0
            self.local_step_interval = min(self.local_step_clipper, self.local_step_interval * 2)

    def _plan(self, active: list, grads: list, t: int, finite: bool) -> list:
        """A sync step's new values, computed aside: (group index, p, new momentum, denominator,
        new accumulated update) per parameter."""
        plan = []
        for (gi, group, p), g in zip(active, grads):
            beta1, beta2 = group["betas"]
            st = U.moments(self.state[p], p)
            den = U.denom(st["exp_avg_sq"], beta2, self.var_updates, group["eps"])
            acc = self._acc.get(p)
            acc = torch.zeros_like(den) if acc is None else acc
            if finite:
                m = torch.lerp(st["exp_avg"], g, 1 - beta1)
                plan.append((gi, p, m, den, acc.addcdiv(m, den, value=-U.step_size(group["lr"], beta1, t))))
            else:
                plan.append((gi, p, st["exp_avg"], den, acc))
        return plan

    def _sync(self, plan: list, lrs: list[float]) -> None:
        """Average the accumulated updates (one compressed allreduce) and replace this interval's
        local steps by the averaged update; nothing changes if the exchange raises."""
        bufs = [acc * den for _, _, _, den, acc in plan]
        poisoned, self._poisoned = self._poisoned, False
        if poisoned:
            if not bufs or bufs[0].numel() == 0:
                raise NonFiniteError(f"{type(self).__name__}: a local step's gradient was not finite")
            bufs[0].view(-1)[0] = float("nan")   # tells every rank through the exchange
        means = mean_compressed(self.onebit, bufs, "update")
        for (gi, p, m, den, _), mean in zip(plan, means):
            base = self._base.get(p)   # the weights of the last sync: the same on every rank
            _set(p, (base if base is not None else p.float()).add(mean / den))
            if lrs[gi] > 0:
                self.state[p]["exp_avg"].copy_(mean).div_(-lrs[gi])
            else:
                self.state[p]["exp_avg"].copy_(m)
        self._acc.clear()
        self._base.clear()
        self.lrs = [0.0] * len(self.param_groups)
        self.last_round = "sync"

    # -- checkpoints ----------------------------------------------------------------------------

    def _counters(self) -> dict:
        return {k: (list(self.lrs) if k == "lrs" else int(getattr(self, k))) for k in _COUNTERS}

    def _set_counters(self, c: dict) -> None:
        for k in _COUNTERS:
            if k == "lrs":
                self.lrs = [float(x) for x in c["lrs"]]
            else:
                setattr(self, k, int(c[k]))

    def load_state_dict(self, state_dict: dict) -> None:
        """Load ``state_dict()``'s output: moments, counters and intervals (``zero_one``)."""
        super().load_state_dict(state_dict)
        self._acc.clear()
        self._base.clear()

    def per_rank_state_dict(self) -> dict:
        """This rank's part of a checkpoint: counters, error feedback and, inside a local
        interval, the local weights, momentum and accumulated update (in parameter order)."""
        params = [p for g in self.param_groups for p in g["params"]]
        local = None
        if self._acc or self._base:
            local = {"params": [p.detach().clone() for p in params],
                     "exp_avg": [self.state[p]["exp_avg"].clone() if "exp_avg" in self.state[p] else None
                                 for p in params],
                     "accumulator": [self._acc[p].clone() if p in self._acc else None for p in params],
                     "sync_params": [self._base[p].clone() if p in self._base else None for p in params]}
        return {self.COUNTERS_KEY: self._counters(), "allreduce": self.onebit.per_rank_state_dict(),
                "local": local}

    def load_per_rank_state_dict(self, saved: list[dict], rank: int, size: int) -> None:
        """Load from every saved rank's ``per_rank_state_dict()`` (rank order). Same world size:
        this rank's own state (an exact resume). Another size: error feedback by
        ``compressed.reshard`` (mean kept); inside a local interval every rank starts from the
        mean over the saved ranks of their weights and momenta, as if synced exactly."""
        self._set_counters(U.same_counters(type(self).__name__, saved, self.COUNTERS_KEY))
        self.onebit.load_per_rank_state_dict([s["allreduce"] for s in saved], rank, size)
        self._acc.clear()
        self._base.clear()
        locals_ = [s.get("local") for s in saved]
        if all(x is None for x in locals_):
            return
        params = [p for g in self.param_groups for p in g["params"]]
        with torch.no_grad():
            if len(saved) == size:
                mine = locals_[rank]
                for i, p in enumerate(params):
                    p.copy_(mine["params"][i])
                    if mine["exp_avg"][i] is not None:
                        self.state[p]["exp_avg"] = mine["exp_avg"][i].to(p.device, torch.float32).clone()
                    if mine["accumulator"][i] is not None:
                        self._acc[p] = mine["accumulator"][i].to(p.device, torch.float32).clone()
                    if mine["sync_params"][i] is not None:
                        self._base[p] = mine["sync_params"][i].to(p.device, torch.float32).clone()
                return
            for i, p in enumerate(params):
                p.copy_(_mean([x["params"][i] for x in locals_]))
                moms = [x["exp_avg"][i] for x in locals_]
                if all(m is not None for m in moms):
                    self.state[p]["exp_avg"] = _mean(moms).to(p.device, torch.float32)
            self.lrs = [0.0] * len(self.param_groups)


def _set(p: torch.Tensor, value: torch.Tensor) -> None:
    """Write an fp32 ``value`` into ``p`` (rounded once for low-precision parameters)."""
    p.copy_(value)


def _mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    acc = torch.zeros_like(tensors[0], dtype=torch.float64, device="cpu")
    for t in tensors:
        acc += t.detach().to("cpu", torch.float64)
    return acc / len(tensors)
