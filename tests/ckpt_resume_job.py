"""A training job for the resume tests (run under mpiexec by tests/test_ckpt_state.py).

``run ROOT K N``: train N steps for each optimizer kind, saving at step K (scheduler, RNG and a
per-rank sampler in ``state=``), and print every step's loss. ``resume ROOT K N``: in fresh
processes, build everything with other seeds, load the step-K checkpoint and train to step N.
Every step draws from Python ``random``, numpy, torch's generator (dropout) and the sampler, so
that a resume that restores any of them wrongly gives other losses.
"""
from __future__ import annotations

import json
import os
import random
import sys

import numpy as np
import torch

import ckpt
from zero import ZeroOptimizer
import mpicomm

KINDS = {"plain": None, "zero1": 1, "zero2": 2}


class Sampler:
    """A per-rank data sampler: a position in a rank-specific permutation, reshuffled per epoch."""

    def __init__(self, rank: int, n: int = 7, seed: int = 0) -> None:
        self.rank, self.n = rank, n
        self.gen = torch.Generator().manual_seed(1000 * seed + rank)
        self.epoch, self.pos = 0, 0
        self.order = torch.randperm(n, generator=self.gen)

    def next(self) -> int:
        if self.pos == self.n:
            self.epoch, self.pos = self.epoch + 1, 0
            self.order = torch.randperm(self.n, generator=self.gen)
        self.pos += 1
        return int(self.order[self.pos - 1])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "order": self.order, "gen": self.gen.get_state()}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.pos, self.order = sd["epoch"], sd["pos"], sd["order"].clone()
        self.gen.set_state(sd["gen"])


def build(kind: str, seed: int, comm):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Dropout(0.3), torch.nn.Linear(9, 2))
    stage = KINDS[kind]
    if stage is None:
        opt = torch.optim.Adam(model.parameters(), lr=0.02)
    else:
        opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=stage, comm=comm, lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    return model, opt, sched, Sampler(comm.rank, seed=seed)


def step(model, opt, sched, sampler, comm) -> float:
    i = sampler.next()
    g = torch.Generator().manual_seed(i)
    x = torch.randn(4, 6, generator=g) + random.random() + float(np.random.rand())
    y = torch.randn(4, 2, generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    if not isinstance(opt, ZeroOptimizer):
        for p in model.parameters():  # plain optimizer: average gradients over the ranks
            comm.all_reduce(p.grad, op="avg")
    opt.step()
    sched.step()
    return float(comm.mpi_comm.allreduce(loss.item()) / comm.size)


def main() -> None:
    mode, root, k, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    comm = mpicomm.as_communicator(None)
    out = {}
    for kind in KINDS:
        path = os.path.join(root, kind)
        if mode == "run":
            random.seed(5 + comm.rank)
            np.random.seed(6 + comm.rank)
            model, opt, sched, sampler = build(kind, seed=0, comm=comm)
            torch.manual_seed(7 + comm.rank)
            losses = []
            for s in range(n):
                if s == k:
                    ckpt.save(path, model=model, optimizer=opt, step=s, comm=comm,
                              state={"sched": sched, "rng": ckpt.RNG(), "sampler": ckpt.PerRank(sampler)})
                losses.append(step(model, opt, sched, sampler, comm))
        else:
            random.seed(99)  # wrong on purpose: the checkpoint must restore every generator
            np.random.seed(99)
            torch.manual_seed(99)
            model, opt, sched, sampler = build(kind, seed=42, comm=comm)
            info = ckpt.load(path, model=model, optimizer=opt, comm=comm,
                             state={"sched": sched, "rng": ckpt.RNG(), "sampler": ckpt.PerRank(sampler)})
            losses = [None] * info.step + [step(model, opt, sched, sampler, comm) for _ in range(info.step, n)]
        out[kind] = losses
    if comm.rank == 0:
        print("LOSSES " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
