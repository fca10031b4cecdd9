"""Resume exactly: save the whole training state (model, ZeRO optimizer, LR scheduler, every random
generator, a per-rank data sampler) and continue bit-identically from the checkpoint.

Run: mpiexec -n 2 python -m mpi4py examples/ckpt_resume.py [DIR]
"""
import os
import random
import sys
import tempfile

import numpy as np
import torch

import ckpt
from zero import ZeroOptimizer
import mpicomm

comm = mpicomm.init()
root = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("MPICOMM_EXAMPLE_DIR") or tempfile.gettempdir()
run_dir = comm.mpi_comm.bcast(os.path.join(root, f"ckpt-resume-{os.getpid()}"), root=0)


class Sampler:
    """Each rank walks its own shuffled order of sample ids; its position is training state."""

    def __init__(self, rank, n=16):
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(rank))
        self.pos = 0

    def next(self):
        self.pos += 1
        return int(self.order[(self.pos - 1) % len(self.order)])

    def state_dict(self):
        return {"order": self.order, "pos": self.pos}

    def load_state_dict(self, state):
        self.order, self.pos = state["order"], state["pos"]


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), stage=1, comm=comm, lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    return model, opt, sched, Sampler(comm.rank)


def train_step(model, opt, sched, sampler):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(sampler.next())) * (1 + np.random.rand())
    loss = (model(x) - random.random()).pow(2).mean()  # dropout draws from torch's generator
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return comm.mpi_comm.allreduce(loss.item()) / comm.size


def state(sched, sampler):
    return {"sched": sched, "rng": ckpt.RNG(), "sampler": ckpt.PerRank(sampler)}


# the run that goes on: save at step 3, continue to step 6
model, opt, sched, sampler = build(seed=0)
random.seed(comm.rank)
np.random.seed(comm.rank)
losses = []
for step in range(6):
    if step == 3:
        ckpt.save(os.path.join(run_dir, "step3"), model=model, optimizer=opt, step=step, comm=comm,
                  state=state(sched, sampler))
    losses.append(train_step(model, opt, sched, sampler))

# the resumed run: everything built anew (other seed, generators scrambled), then loaded
model, opt, sched, sampler = build(seed=123)
random.seed(99)
np.random.seed(99)
torch.manual_seed(99)
info = ckpt.load(run_dir, model=model, optimizer=opt, comm=comm, state=state(sched, sampler))
resumed = [train_step(model, opt, sched, sampler) for _ in range(info.step, 6)]
if resumed != losses[info.step:]:
    raise SystemExit(f"resume differs: {resumed} != {losses[info.step:]}")
if comm.rank == 0:
    print(f"resumed at step {info.step}: losses {resumed} identical to the run that went on")
