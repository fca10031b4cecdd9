"""Shared by elastic's tests and fault-injection job: a tiny model, deterministic data, and the
single-process reference training (plain torch, no elastic, no MPI)."""
from __future__ import annotations

import numpy as np
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


def join_shards(layout, rows) -> torch.Tensor:
    """Every rank's local ZeroOptimizer shard (``rows[r]``) joined into the group's flat buffer
    in parameter order."""
    offsets = np.cumsum([0] + list(layout.numels))
    index = {pid: i for i, pid in enumerate(layout.param_ids)}
    out = torch.empty(layout.total_numel, dtype=rows[0].dtype)
    for r, row in enumerate(rows):
        for s in layout.segments(r):
            lo = int(offsets[index[s.param]]) + s.start
            out[lo:lo + s.length] = row.reshape(-1)[s.local:s.local + s.length]
    return out


def onebit_frozen_steps(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, first: int,
                        last: int, freeze: int, betas=(0.9, 0.999), eps: float = 1e-8) -> torch.Tensor:
    """Steps ``first`` to ``last - 1`` of 1-bit Adam past its freeze on one process (nothing to
    compress): the momentum goes on from ``exp_avg``, the variance stays as frozen at step
    ``freeze``; float64 from the flat ``master`` weights. Returns the flat weights after them."""
    model = make_model()
    w, m = master.double().clone(), exp_avg.double().clone()
    den = (exp_avg_sq.double() / (1 - betas[1] ** freeze)).sqrt() + eps
    for t in range(first, last):
        torch.nn.utils.vector_to_parameters(w.float(), model.parameters())
        model.zero_grad()
        local_loss(model, t, 0, 1).backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
        m = betas[0] * m + (1 - betas[0]) * g
        w = w - LR / (1 - betas[0] ** (t + 1)) * m / den
    return w


def allgather_rows(comm, t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (the same shape on each), stacked in rank order (collective)."""
    out = torch.empty(comm.size * t.numel(), dtype=t.dtype)
    comm.all_gather_into_tensor(out, t.reshape(-1).contiguous())
    return out.view(comm.size, *t.shape)


def onebit_commit_view(opt) -> dict[str, torch.Tensor]:
    """What a commit of a frozen 1-bit Adam ZeroOptimizer must hold, gathered over its ranks
    independently of elastic (collective): the flat fp32 masters, the frozen variance, and the
    float64 mean of the ranks' local momenta (what a rollback restarts from)."""
    g = opt.groups[0]
    (loc,) = opt.optimizer._local.values()
    means = allgather_rows(opt.comm, loc["mom"]).double().mean(0)[:, :g.layout.local_numel]  # (owner, chunk)
    return {"master": join_shards(g.layout, list(allgather_rows(opt.comm, g.master))),
            "exp_avg_sq": join_shards(g.layout, list(allgather_rows(opt.comm, opt.optimizer.state[g.master]["exp_avg_sq"]))),
            "exp_avg": join_shards(g.layout, list(means))}
