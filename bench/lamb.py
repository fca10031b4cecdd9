"""Plain LAMB, the exact reference of ``bench train --curve``'s ``OnebitLamb`` curve.

Kept here on purpose, written apart from ``compressed/lamb.py``: torch has no LAMB, and
``OnebitLamb``'s own warm-up is the code under test, so a curve drawn with it would agree with
itself. The 1-bit curve must coincide with this one up to ``freeze_step``; that only shows
something when the two are separate implementations of the same rule.
"""
from __future__ import annotations

__all__ = ["Lamb"]


class Lamb:
    """Plain LAMB (torch has none) as ``compressed.OnebitLamb``'s warm-up runs it: no bias
    correction, weight decay inside the trust ratio, the ratio clamped to [min_coeff, max_coeff]."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01) -> None:
        import torch

        self.params = list(params)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.max_coeff, self.min_coeff = max_coeff, min_coeff
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        import torch

        b1, b2 = self.betas
        with torch.no_grad():
            for p, m, v in zip(self.params, self.m, self.v):
                if p.grad is None:
                    continue
                m.lerp_(p.grad, 1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                u = m / (v.sqrt() + self.eps) + self.wd * p
                wn, un = float(p.norm()), float(u.norm())
                c = 1.0 if wn == 0 or un == 0 else min(max(wn / un, self.min_coeff), self.max_coeff)
                p.sub_(u, alpha=self.lr * c)
