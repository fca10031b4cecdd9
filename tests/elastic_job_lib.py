"""Shared by elastic's tests and fault-injection job: a tiny model, deterministic data, and the
single-process reference training (plain torch, no elastic, no MPI)."""
from __future__ import annotations

import torch

from elastic import ElasticSampler

SAMPLES, BATCH, LR = 96, 12, 0.02


def make_model(seed: int = 7) -> torch.nn.Module:
    """Odd sizes, so both ZeroOptimizer stages pad at 3 and 4 ranks."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(SAMPLES, 5, generator=g), torch.randn(SAMPLES, 3, generator=g)


def sampler() -> ElasticSampler:
    return ElasticSampler(SAMPLES, BATCH, seed=5)


def local_loss(model: torch.nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's share of step ``step``'s global-mean loss (times ``world``: ranks average)."""
    x, y = data()
    s = sampler()
    idx = s.local_indices(step, rank, world)
    return s.loss_scale(world) * ((model(x[idx]) - y[idx]) ** 2).sum()


def reference(steps: int, optimizer=lambda params: torch.optim.Adam(params, lr=LR), scheduler=None
              ) -> list[torch.Tensor]:
    """Final weights after ``steps`` steps of ``optimizer`` (default: Adam) on the global
    batches, one process; ``scheduler(opt)``: an LR scheduler stepped after each step."""
    model = make_model()
    opt = optimizer(model.parameters())
    lr_sched = scheduler(opt) if scheduler is not None else None
    x, y = data()
    s = sampler()
    for step in range(steps):
        idx = s.global_indices(step)
        loss = ((model(x[idx]) - y[idx]) ** 2).sum() / BATCH
        opt.zero_grad()
        loss.backward()
        opt.step()
        if lr_sched is not None:
            lr_sched.step()
    return [p.detach().clone() for p in model.parameters()]
