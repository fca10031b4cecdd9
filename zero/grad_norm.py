"""The averaged gradient's norm, the checks agreed with it in one small allreduce, and clipping.

``GradNorm`` is a part of ``ZeroOptimizer`` (its base): ``clip_grad_norm_`` and the ``_sync``
that ``step()`` runs when nothing clipped first. It reads the optimizer's shard groups, reducer
and communicator, and agrees over all ranks, in one allreduce of five numbers, on the norm,
non-finite values, gradients modified in place after backward and buckets sent stale.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .onebit import ShardedOnebitAdam

_MODIFIED = (
    "ZeroOptimizer: the gradients of {n} parameter(s) were modified in place after backward and "
    "before step() (on ranks {ranks}). With a ZeroOptimizer each rank holds its local, unaveraged "
    "gradient until step() averages it, so torch.nn.utils.clip_grad_norm_(model.parameters(), ...) "
    "clips with a rank-local norm and torch.amp.GradScaler.unscale_ unscales rank-local gradients: "
    "both are wrong here. Clip with opt.clip_grad_norm_(max_norm) (the norm of the averaged "
    "gradient), scale the loss instead of the gradients, and call opt.zero_grad() before backward.")


class GradNorm:
    """The norm of the averaged gradient (collective), its checks, and ``clip_grad_norm_``."""

    _groups: list[Any]
    _reducer: Any
    _seen: dict[tuple[int, int], tuple[Any, int]]
    _synced: tuple[float, float] | None
    _finite: bool | None
    optimizer: torch.optim.Optimizer
    comm: Any
    world_size: int
    rank: int

    def _averages_grads(self) -> bool:
        """Whether backward's gradients are averaged (not after 1-bit Adam's freeze_step)."""
        return not (isinstance(self.optimizer, ShardedOnebitAdam) and self.optimizer.frozen)

    def _end_cycle(self) -> None:
        self._synced = None
        self._finite = None
        self._seen.clear()
        self._reducer.reset()

    def _local_power(self, norm_type: float) -> tuple[float, bool]:
        grads = ([g.master.grad for g in self._groups if g.master.grad is not None]
                 if self._averages_grads() else
                 [p.grad for g in self._groups for p in g.params if p.grad is not None])
        acc, finite = 0.0, True
        for t in grads:
            if t.numel() == 0:
                continue
            t = t.detach().float()
            if math.isinf(norm_type):
                v = float(t.abs().max())
                acc = max(acc, v)
            else:
                v = float(torch.linalg.vector_norm(t, norm_type, dtype=torch.float64) ** norm_type)
                acc += v
            finite = finite and math.isfinite(v)
        return acc, finite

    def _modified(self) -> int:
        n = 0
        for (gi, pi), (ref, version) in self._seen.items():
            if (gi, pi) in self._reducer.released:
                continue
            p, t = self._groups[gi].params[pi], ref()
            if p.grad is not t or (t is not None and t._version != version):
                n += 1
        return n

    def _sync(self, norm_type: float) -> tuple[float, bool]:
        """Reduce the gradients (if not yet), then agree over all ranks, in one small allreduce, on
        the gradient norm, non-finite values and modified gradients; return (norm, finite)."""
        if self._synced is not None and self._synced[0] == norm_type:
            return self._synced[1], bool(self._finite)
        averaging = self._averages_grads()
        for attempt in range(2):
            modified = self._modified()      # before finish() releases (stage 2) what it sends
            if averaging:
                self._reducer.finish()
            acc, finite = self._local_power(norm_type)
            stale = self._reducer.stale if averaging else False
            by_max = math.isinf(norm_type)
            # [norm power, non-finite, modified count, stale, which ranks modified (bit mask)]
            vec = torch.tensor([acc if finite else math.inf, float(not finite), float(modified), float(stale),
                                float(modified > 0) * (1.0 if by_max else 2.0 ** min(self.rank, 52))],
                               dtype=torch.float64)
            if self.world_size > 1:
                self.comm.all_reduce(vec, op="max" if by_max else "sum")
            if vec[2] > 0:
                self._end_cycle()
                ranks = "unknown (inf norm)" if by_max else \
                    [r for r in range(min(self.world_size, 53)) if int(vec[4]) >> r & 1]
                raise RuntimeError(_MODIFIED.format(n=int(vec[2]), ranks=ranks))
            if vec[3] > 0 and self._reducer.release:
                # a backward sent gradients before the one before it ended its round (it raised
                # midway): what was released cannot be sent again
                self._end_cycle()
                raise RuntimeError("ZeroOptimizer(stage=2): a backward sent gradients before the previous "
                                   "backward had finished (did it raise?); the gradients of this step are "
                                   "lost: call opt.zero_grad() and run the step's backward passes again")
            if vec[3] > 0 and attempt == 0:
                # a bucket's gradient grew after it was sent (backward again without no_sync):
                # every rank sends all buckets again, now that all gradients are final
                self._reducer.reset()
                continue
            break
        finite = bool(vec[1] == 0)
        norm = float(vec[0]) if by_max else float(vec[0]) ** (1.0 / norm_type)
        if not finite:
            norm = math.nan
        self._synced = (norm_type, norm)
        self._finite = finite
        return norm, finite

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the averaged gradient (all parameters, all ranks) to ``max_norm``; return its norm.

        Collective. Like ``torch.nn.utils.clip_grad_norm_`` on the averaged gradient: the norm is
        taken over all parameters together (``inf``: the largest magnitude) and the shards are
        scaled by ``max_norm / (norm + 1e-6)`` when that is below 1, before ``step()`` (left
        as they are when the norm is not finite: see ``skip_nonfinite``).
        """
        norm_type = float(norm_type)
        if not (norm_type > 0):
            raise ValueError(f"clip_grad_norm_: expected norm_type > 0 or inf, got {norm_type}")
        if not self._averages_grads():
            raise RuntimeError("clip_grad_norm_: after freeze_step 1-bit Adam averages compressed momenta, "
                               "not gradients; there is no averaged gradient to clip")
        norm, finite = self._sync(norm_type)
        if not finite and error_if_nonfinite:
            raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the averaged "
                               "gradients is non-finite; set error_if_nonfinite=False to clip anyway")
        coef = float(max_norm) / (norm + 1e-6) if finite else 1.0   # non-finite: left as they are
        if coef < 1.0:
            for g in self._groups:
                if g.master.grad is not None:
                    g.master.grad.mul_(coef)
            self._synced = None
        return torch.tensor(norm, dtype=torch.float32)


__all__ = ["GradNorm"]
