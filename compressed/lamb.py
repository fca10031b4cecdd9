"""OnebitLamb: 1-bit LAMB (Li et al., arXiv 2104.06069, as in DeepSpeed) on the 1-bit engine."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from . import adam_update as U
from .allreduce import OnebitAllreduce
from .flat import mean_compressed, mean_exact
from .onebit_optimizer import OnebitOptimizer
from .transport import as_comm

__all__ = ["OnebitLamb", "trust_ratio", "frozen_factor"]


def trust_ratio(p: torch.Tensor, update: torch.Tensor, min_coeff: float, max_coeff: float) -> float:
    """LAMB's ||p|| / ||update||, clamped to [min_coeff, max_coeff]; 1.0 if either norm is 0."""
    wn = float(p.detach().float().norm())
    un = float(update.norm())
    if wn == 0 or un == 0:
        return 1.0
    return min(max(wn / un, min_coeff), max_coeff)


def frozen_factor(den: torch.Tensor, den_fresh: torch.Tensor, prelim_norm: float, update_norm: float,
                  weight_decay: float, last: float, lo: float, hi: float, threshold: float) -> float:
    """The factor on the frozen trust ratio: max(frozen denominator / fresh one), mixed toward 1
    by the share of the update that is not weight decay, clamped to [lo, hi] and to within
    ``threshold`` (relative) of the last factor."""
    factor = float((den / den_fresh).max())
    if weight_decay > 0 and update_norm > 0:
        ratio = min(1.0, prelim_norm / update_norm)
        factor = factor * ratio + (1.0 - ratio)
    factor = min(max(factor, lo), hi)
    return min(max(factor, last * (1.0 - threshold)), last * (1.0 + threshold))


class OnebitLamb(OnebitOptimizer):
    """1-bit LAMB over an mpicomm communicator or a torch.distributed process group (``comm``).

    Steps 1..``freeze_step`` are LAMB on gradients averaged exactly (one allreduce per step):
    ``u = m / (sqrt(v) + eps) + weight_decay * p`` and ``p -= lr * c * u`` with the trust ratio
    ``c = ||p|| / ||u||`` clamped to ``[min_coeff, max_coeff]``; the ratios (when not 1) feed a
    running average with ``coeff_beta``: the frozen ratio. At ``freeze_step`` the variance is
    copied to a *fresh* variance.

    After it, the variance is frozen; each rank folds its own gradient into the momentum, and the
    momenta of all parameters, each scaled by a coefficient that puts them on one scale (fixed at
    the first compressed step: the mean over parameters of ``||m|| / sqrt(numel)`` divided by the
    parameter's own), go in one compressed allreduce per device. The gradient rebuilt from the
    averaged momentum updates the fresh variance; the step uses the frozen ratio times a factor
    (``frozen_factor``: bounded by ``factor_min``/``factor_max``, moving at most
    ``factor_threshold`` per step).

    As DeepSpeed's (``onebit/lamb.py``): no bias correction, weight decay decoupled (inside the
    trust ratio), the same defaults; unlike it there is no no-op first step, and the error
    feedback is saved per rank (``per_rank_state_dict``) instead of dropped on load. A
    non-finite gradient after the freeze raises ``NonFiniteError`` on every rank with nothing
    changed. ``lamb_coeffs`` holds the last step's ratios, in parameter order.

    ``state_dict()`` is torch's optimizer state (fp32 moments, fresh variance, frozen ratios,
    last factors, scaling coefficients) plus ``onebit_lamb``: the step counters (the same on
    every rank).
    """

    COUNTERS_KEY = "onebit_lamb"
    FP32_STATE = ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh")

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, freeze_step: int = 100000,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9,
                 factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1,
                 comm: Any = None, *, cuda_aware: bool = False) -> None:
        name = type(self).__name__
        betas = U.check_adam(name, lr, betas, eps, weight_decay)
        self.freeze_step = U.check_int(name, "freeze_step", freeze_step, 1)
        U.check_range(name, "max_coeff", max_coeff, 0.0, lo_open=True)
        U.check_range(name, "min_coeff", min_coeff, 0.0, float(max_coeff), lo_open=True)
        self.coeff_beta = U.check_range(name, "coeff_beta", coeff_beta, 0.0, 1.0, hi_open=True)
        self.factor_max = U.check_range(name, "factor_max", factor_max, 1.0)
        self.factor_min = U.check_range(name, "factor_min", factor_min, 0.0, 1.0, lo_open=True)
        self.factor_threshold = U.check_range(name, "factor_threshold", factor_threshold, 0.0, 1.0,
                                              hi_open=True)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      max_coeff=float(max_coeff), min_coeff=float(min_coeff)))
        self.comm = as_comm(comm)
        self.onebit = OnebitAllreduce(self.comm, cuda_aware=cuda_aware)
        self.global_step = 0
        self.lamb_coeffs: list[float] = []

    def get_lamb_coeffs(self) -> list[float]:
        """The last step's trust ratios (as DeepSpeed's)."""
        return list(self.lamb_coeffs)

    def _warm_step(self, active: list, t: int) -> None:
        grads = mean_exact(self.comm, [p.grad for _, _, p in active])
        self.lamb_coeffs = []
        for (_, group, p), g in zip(active, grads):
            beta1, beta2 = group["betas"]
            st = U.moments(self.state[p], p)
            st.setdefault("lamb_coeff_freeze", 0.0)
            st.setdefault("last_factor", 1.0)
            st["exp_avg"].lerp_(g, 1 - beta1)
            st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            if t == self.freeze_step:
                st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()
            update = st["exp_avg"] / (st["exp_avg_sq"].sqrt() + group["eps"])
            if group["weight_decay"]:
                update.add_(p.detach().float(), alpha=group["weight_decay"])
            coeff = trust_ratio(p, update, group["min_coeff"], group["max_coeff"])
            if coeff != 1.0:
                cb = self.coeff_beta
                st["lamb_coeff_freeze"] = cb * st["lamb_coeff_freeze"] + (1 - cb) * coeff
            self.lamb_coeffs.append(coeff)
            _set(p, p.float().sub_(update, alpha=group["lr"] * coeff))

    def _scaling(self) -> None:
        """Fix each momentum's scaling coefficient (once, from the warm-up's last momenta)."""
        params = [p for g in self.param_groups for p in g["params"] if "exp_avg" in self.state[p]]
        if not params or all("scaling_coeff" in self.state[p] for p in params):
            return
        scales = [float(self.state[p]["exp_avg"].norm()) / max(1, p.numel()) ** 0.5 for p in params]
        united = sum(scales) / len(scales)
        for p, s in zip(params, scales):
            self.state[p]["scaling_coeff"] = united / s if s > 0 else 1.0

    def _frozen_step(self, active: list, t: int) -> None:
        self._scaling()
        for _, _, p in active:
            st = U.moments(self.state[p], p)
            st.setdefault("scaling_coeff", 1.0)
            st.setdefault("lamb_coeff_freeze", 0.0)
            st.setdefault("last_factor", 1.0)
            if "exp_avg_sq_fresh" not in st:
                st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()
        scaled = []
        for _, group, p in active:
            st = self.state[p]
            m = st["exp_avg"].mul(group["betas"][0]).add_(p.grad.float(), alpha=1 - group["betas"][0])
            scaled.append(m.mul_(st["scaling_coeff"]))
        means = mean_compressed(self.onebit, scaled, "exp_avg")   # NonFiniteError: nothing changed
        self.lamb_coeffs = []
        for (_, group, p), mean in zip(active, means):
            st = self.state[p]
            beta1, beta2 = group["betas"]
            wd = group["weight_decay"]
            m = mean.div_(st["scaling_coeff"])
            rebuilt = (m - st["exp_avg"] * beta1) / (1 - beta1)
            st["exp_avg"].copy_(m)
            st["exp_avg_sq_fresh"].mul_(beta2).addcmul_(rebuilt, rebuilt, value=1 - beta2)
            den = st["exp_avg_sq"].sqrt() + group["eps"]
            prelim = st["exp_avg"] / den
            update = prelim + wd * p.detach().float() if wd else prelim
            factor = frozen_factor(den, st["exp_avg_sq_fresh"].sqrt() + group["eps"],
                                   float(prelim.norm()), float(update.norm()), wd, st["last_factor"],
                                   self.factor_min, self.factor_max, self.factor_threshold)
            st["last_factor"] = factor
            coeff = st["lamb_coeff_freeze"] * factor
            self.lamb_coeffs.append(coeff)
            _set(p, p.float().sub_(update, alpha=group["lr"] * coeff))

    # -- checkpoints ----------------------------------------------------------------------------

    def per_rank_state_dict(self) -> dict:
        """This rank's part of a checkpoint: the step counters and the error feedback of the
        compressed momentum."""
        return {self.COUNTERS_KEY: self._counters(), "allreduce": self.onebit.per_rank_state_dict()}

    def load_per_rank_state_dict(self, saved: list[dict], rank: int, size: int) -> None:
        """Load from every saved rank's ``per_rank_state_dict()`` (rank order): exact at the same
        world size, error mass carried to another size (``compressed.reshard``)."""
        self._set_counters(U.same_counters(type(self).__name__, saved, self.COUNTERS_KEY))
        self.onebit.load_per_rank_state_dict([s["allreduce"] for s in saved], rank, size)


def _set(p: torch.Tensor, value: torch.Tensor) -> None:
    p.copy_(value)
