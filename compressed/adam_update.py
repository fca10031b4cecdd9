"""The 1-bit Adam family's shared pieces: hyperparameter checks and the bias-corrected update.

One definition, used by ``compressed.OnebitAdam``, ``compressed.ZeroOneAdam`` and the sharded
1-bit Adam of ``zero``: moments in fp32, L2 weight decay added to the gradient, and
``p -= lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^n)) + eps)`` where ``n`` counts the
variance updates so far (the variance is frozen or updated at intervals after a while). Before
any freeze this is ``torch.optim.Adam``'s update.
"""
from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["check_range", "check_adam", "check_int", "moments", "with_weight_decay", "denom",
           "load_fp32_state",
           "same_counters", "step_size", "apply_", "adam_update_"]


def check_range(owner: str, name: str, value: Any, lo: float | None = None, hi: float | None = None,
                *, lo_open: bool = False, hi_open: bool = False) -> float:
    """``value`` as a float, or a ValueError naming ``owner``'s parameter ``name`` and its range."""
    lo_s = "-inf" if lo is None else repr(lo)
    hi_s = "inf" if hi is None else repr(hi)
    interval = f"{'(' if lo_open or lo is None else '['}{lo_s}, {hi_s}{')' if hi_open or hi is None else ']'}"
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: {name} must be a number in {interval}, got {value!r}") from None
    bad = (math.isnan(v) or (lo is not None and (v <= lo if lo_open else v < lo))
           or (hi is not None and (v >= hi if hi_open else v > hi)))
    if bad:
        raise ValueError(f"{owner}: {name} must be in {interval}, got {value!r}")
    return v


def check_int(owner: str, name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, or a ValueError naming the parameter and its range."""
    if isinstance(value, bool) or not isinstance(value, (int,)) and not (
            isinstance(value, float) and value.is_integer()):
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_adam(owner: str, lr: Any, betas: Any, eps: Any, weight_decay: Any) -> tuple[float, float]:
    """Check Adam's hyperparameters (ValueError naming the one out of range); return the betas."""
    check_range(owner, "lr", lr, 0.0)
    check_range(owner, "eps", eps, 0.0)
    check_range(owner, "weight_decay", weight_decay, 0.0)
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: betas must be a pair (beta1, beta2), got {betas!r}") from None
    return (check_range(owner, "betas[0]", b1, 0.0, 1.0, hi_open=True),
            check_range(owner, "betas[1]", b2, 0.0, 1.0, hi_open=True))


def moments(state: dict, like: torch.Tensor, *names: str) -> dict:
    """Create the fp32 zero moments ``names`` (default exp_avg, exp_avg_sq) missing from ``state``."""
    for name in names or ("exp_avg", "exp_avg_sq"):
        if name not in state:
            state[name] = torch.zeros_like(like, dtype=torch.float32, memory_format=torch.preserve_format)
    return state


def with_weight_decay(g: torch.Tensor, p: torch.Tensor, weight_decay: float) -> torch.Tensor:
    """The fp32 gradient plus the L2 term ``weight_decay * p`` (``g`` itself when it is fp32 and
    there is no decay: callers must not modify the result in place)."""
    g = g.float()
    return g.add(p.detach().float(), alpha=weight_decay) if weight_decay else g


def denom(exp_avg_sq: torch.Tensor, beta2: float, n_var: int, eps: float) -> torch.Tensor:
    """``sqrt(v / (1 - beta2^n_var)) + eps`` (no correction when ``n_var`` is 0), a new tensor."""
    bc2 = 1 - beta2 ** n_var if n_var > 0 else 1.0
    return (exp_avg_sq.sqrt() / (bc2 ** 0.5 if bc2 > 0 else 1.0)).add_(eps)


def step_size(lr: float, beta1: float, t: int) -> float:
    """``lr / (1 - beta1^t)``: the learning rate with the momentum's bias correction."""
    return lr / (1 - beta1 ** t)


def apply_(p: torch.Tensor, num: torch.Tensor, den: torch.Tensor, step: float) -> None:
    """``p -= step * num / den`` computed in fp32, rounded once into a low-precision ``p``."""
    if p.dtype == torch.float32:
        p.addcdiv_(num, den, value=-step)
    else:
        p.copy_(p.float().addcdiv_(num, den, value=-step))


@torch.no_grad()
def adam_update_(p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, lr: float,
                 betas: tuple[float, float], eps: float, t: int, n_var: int) -> None:
    """Adam's bias-corrected update of ``p`` at step ``t`` after ``n_var`` variance updates."""
    apply_(p, exp_avg, denom(exp_avg_sq, betas[1], n_var, eps), step_size(lr, betas[0], t))


def load_fp32_state(opt: torch.optim.Optimizer, state_dict: dict, names: tuple[str, ...]) -> None:
    """After ``torch.optim.Optimizer.load_state_dict`` (which casts floating state to each
    parameter's dtype): put the saved fp32 tensors ``names`` back, on the parameter's device."""
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in zip(saved_ids, params):
        saved = state_dict["state"].get(i, {})
        for name in names:
            if isinstance(saved.get(name), torch.Tensor):
                opt.state[p][name] = saved[name].detach().to(p.device, torch.float32).clone()


def same_counters(owner: str, saved: list[dict], key: str) -> dict:
    """The step counters ``saved[i][key]`` every saved rank holds (ValueError if they differ)."""
    values = [dict(s[key]) for s in saved]
    if any(v != values[0] for v in values[1:]):
        raise ValueError(f"{owner}.load_per_rank_state_dict: the saved ranks disagree on the step "
                         f"counters: {values}")
    return values[0]
