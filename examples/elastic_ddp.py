"""DDP training that survives a lost rank in the same job (Open MPI's ULFM), with elastic.

Run: mpirun --with-ft ulfm -n 3 python examples/elastic_ddp.py --kill-rank 1 --kill-step 3
(without --kill-rank, and on any MPI: `mpiexec -n 2 python -m mpi4py examples/elastic_ddp.py`).
"""
from __future__ import annotations

import argparse
import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic
import mpicomm
from mpicomm import distributed as mdist

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--kill-rank", type=int, default=None, help="world rank that os._exit(9)s")
parser.add_argument("--kill-step", type=int, default=2, help="step at which it does")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--min-world-size", type=int, default=1)
args = parser.parse_args()

comm = mpicomm.init()
world_rank = comm.rank
mdist.init_process_group()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
gen = torch.Generator().manual_seed(1)
x = torch.randn(512, 16, generator=gen)
y = x.sum(1, keepdim=True)
sampler = elastic.ElasticSampler(len(x), global_batch_size=32, seed=2)   # the same batch at any size

state = elastic.TorchState(model=model, optimizer=opt, step=0)


def make_ddp() -> DDP:
    return DDP(model)


ddp = make_ddp()


def rebuild_ddp() -> None:
    """After a recovery: DDP again, on the new default process group (the survivors)."""
    global ddp
    ddp = make_ddp()


state.register_reset_callbacks([rebuild_ddp])


@elastic.run(min_world_size=args.min_world_size)
def train(state: elastic.TorchState) -> None:
    while state.step < args.steps:
        if world_rank == args.kill_rank and state.step == args.kill_step:
            os._exit(9)                                   # a crash, as a node loss would be
        idx = sampler.local_indices(state.step, state.rank, state.world_size)
        loss = sampler.loss_scale(state.world_size) * torch.nn.functional.mse_loss(
            ddp(x[idx]), y[idx], reduction="sum")
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.step += 1
        state.commit()                                    # what a recovery rolls back to


train(state)
if state.rank == 0:
    for r in state.recoveries:
        print(f"recovered from the loss of world ranks {r['lost']} in {r['recover_s']:.2f} s "
              f"(back to commit {r['generation']})")
    print(f"trained {state.step} steps on {state.world_size} ranks")
