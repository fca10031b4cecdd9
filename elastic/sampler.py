"""A deterministic global batch per step, re-split over whatever world is training now."""
from __future__ import annotations

import torch


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part ``index`` of ``total`` items split in ``parts`` nearly equal runs."""
    if parts <= 0 or not 0 <= index < parts:
        raise ValueError(f"expected 0 <= index < parts, got index={index}, parts={parts}")
    return total * index // parts, total * (index + 1) // parts


class ElasticSampler:
    """Which samples each rank takes at each step, so the global batch does not depend on the
    world size: step ``s`` always trains on the same ``global_batch_size`` samples, split over
    the current ranks in rank order.

    With ``loss = sampler.loss_scale(world) * loss_fn(..., reduction="sum")`` and gradients
    averaged over the ranks (DDP, ZeroOptimizer), every step's gradient is the mean over the
    global batch at any world size, so a run that lost a rank ends with the weights of one that
    did not (to the reduction-order rounding).
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if global_batch_size < 1 or num_samples < global_batch_size:
            raise ValueError(f"ElasticSampler: expected 1 <= global_batch_size <= num_samples, "
                             f"got global_batch_size={global_batch_size}, num_samples={num_samples}")
        self.num_samples = int(num_samples)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self._epoch: tuple[int, torch.Tensor] | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per pass over the samples (the rest of a pass is dropped)."""
        return self.num_samples // self.global_batch_size

    def _order(self, epoch: int) -> torch.Tensor:
        if self._epoch is None or self._epoch[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order = torch.randperm(self.num_samples, generator=g)
            else:
                order = torch.arange(self.num_samples)
            self._epoch = (epoch, order)
        return self._epoch[1]

    def global_indices(self, step: int) -> torch.Tensor:
        """The samples of global step ``step`` (the same at every world size)."""
        if step < 0:
            raise ValueError(f"ElasticSampler: expected step >= 0, got {step}")
        epoch, k = divmod(int(step), self.steps_per_epoch)
        lo = k * self.global_batch_size
        return self._order(epoch)[lo:lo + self.global_batch_size]

    def local_indices(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        """The samples rank ``rank`` of ``world_size`` trains on at step ``step``."""
        if world_size > self.global_batch_size:
            raise ValueError(f"ElasticSampler: {world_size} ranks cannot share a global batch of "
                             f"{self.global_batch_size} samples (a rank would get none)")
        lo, hi = split_range(self.global_batch_size, world_size, rank)
        return self.global_indices(step)[lo:hi]

    def loss_scale(self, world_size: int) -> float:
        """Factor for a summed per-sample loss so that rank-averaged gradients are the global mean."""
        return world_size / self.global_batch_size
