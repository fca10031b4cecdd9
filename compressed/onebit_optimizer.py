"""OnebitOptimizer: what the 1-bit optimizers share: the step's frame, the checkpointed counters."""
from __future__ import annotations

from typing import Any, Callable

import torch

from . import adam_update as U

__all__ = ["OnebitOptimizer"]


class OnebitOptimizer(torch.optim.Optimizer):
    """Base of ``OnebitAdam``, ``ZeroOneAdam`` and ``OnebitLamb``.

    ``step`` runs ``_warm_step(active, t)`` while ``frozen`` is False and ``_frozen_step(active,
    t)`` after, where ``t = global_step + 1`` and ``active`` lists (group index, group, parameter)
    for every parameter with a gradient (a sparse one raises RuntimeError), then sets
    ``global_step = t``. ``state_dict()`` is torch's plus the step counters (``_counters()``,
    the same on every rank) under ``COUNTERS_KEY``; ``load_state_dict`` takes them back
    (``_set_counters``) and puts the fp32 state tensors ``FP32_STATE`` back as saved (torch casts
    them to each parameter's dtype).
    """

    #: Key of the step counters in ``state_dict()``.
    COUNTERS_KEY = "onebit"
    #: State tensors kept in fp32 whatever the parameter's dtype.
    FP32_STATE: tuple[str, ...] = ("exp_avg", "exp_avg_sq")

    global_step: int
    freeze_step: int

    @property
    def frozen(self) -> bool:
        """Whether the next step uses compressed momentum."""
        return self.global_step >= self.freeze_step

    def _warm_step(self, active: list, t: int) -> None:
        raise NotImplementedError

    def _frozen_step(self, active: list, t: int) -> None:
        raise NotImplementedError

    def _with_grads(self) -> list[tuple[int, dict, torch.Tensor]]:
        out = []
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError(f"{type(self).__name__} does not support sparse "
                                           f"gradients")
                    out.append((gi, g, p))
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Take one optimisation step (collective: every rank calls it every step)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active = self._with_grads()
        t = self.global_step + 1
        if self.frozen:
            self._frozen_step(active, t)
        else:
            self._warm_step(active, t)
        self.global_step = t
        return loss

    def _counters(self) -> dict:
        return {"global_step": self.global_step, "freeze_step": self.freeze_step}

    def _set_counters(self, c: dict) -> None:
        self.global_step = int(c["global_step"])
        self.freeze_step = int(c["freeze_step"])

    def state_dict(self) -> dict:
        """torch's optimizer state (fp32 state tensors) plus the step counters under
        ``COUNTERS_KEY`` (the same on every rank)."""
        sd = super().state_dict()
        sd[self.COUNTERS_KEY] = self._counters()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load ``state_dict()``'s output: state tensors (fp32 as saved) and step counters."""
        state_dict = dict(state_dict)
        extra = state_dict.pop(self.COUNTERS_KEY, None)
        super().load_state_dict(state_dict)
        U.load_fp32_state(self, state_dict, self.FP32_STATE)
        if extra is not None:
            self._set_counters(extra)
