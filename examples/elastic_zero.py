"""ZeroOptimizer (stage 2) training that survives a lost rank: its shard comes back from the
buddy replica and the state is re-partitioned over the survivors, in memory.

Run: mpirun --with-ft ulfm -n 3 python examples/elastic_zero.py --kill-rank 1 --kill-step 3
(without --kill-rank, and on any MPI: `mpiexec -n 2 python -m mpi4py examples/elastic_zero.py`).
"""
from __future__ import annotations

import argparse
import os

import torch

import elastic
import mpicomm
from zero import ZeroOptimizer

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--kill-rank", type=int, default=None, help="world rank that os._exit(9)s")
parser.add_argument("--kill-step", type=int, default=2, help="step at which it does")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--stage", type=int, default=2, choices=(1, 2))
args = parser.parse_args()

comm = mpicomm.init()
world_rank = comm.rank
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), stage=args.stage, comm=comm.dup(), lr=1e-2)
gen = torch.Generator().manual_seed(1)
x = torch.randn(512, 16, generator=gen)
y = x.sum(1, keepdim=True)
sampler = elastic.ElasticSampler(len(x), global_batch_size=32, seed=2)

state = elastic.TorchState(model=model, optimizer=opt, step=0)   # state.comm is opt.comm


@elastic.run
def train(state: elastic.TorchState) -> None:
    while state.step < args.steps:
        if world_rank == args.kill_rank and state.step == args.kill_step:
            os._exit(9)
        idx = sampler.local_indices(state.step, state.rank, state.world_size)
        loss = sampler.loss_scale(state.world_size) * torch.nn.functional.mse_loss(
            model(x[idx]), y[idx], reduction="sum")
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.step += 1
        state.commit()        # the shard goes to the buddy rank too


train(state)
if state.rank == 0:
    for r in state.recoveries:
        print(f"recovered from the loss of world ranks {r['lost']} in {r['recover_s']:.2f} s "
              f"(back to commit {r['generation']})")
    print(f"trained {state.step} steps on {state.world_size} ranks (ZeroOptimizer over "
          f"{opt.world_size} ranks, stage {opt.stage})")
