"""Restart job for tests/test_elastic_restart.py: train under elastic.run with disk checkpoints.

    mpiexec -n N python tests/elastic_restart_job.py OPT DIR STEPS KILL_RANK KILL_STEP OUT

OPT: ddp | zero2; DIR: checkpoint_dir (a checkpoint every 2 commits); KILL_RANK dies with
os._exit(9) at the start of step KILL_STEP (-1: nobody), so an MPI without ULFM ends the whole
job. A relaunch resumes from DIR's newest checkpoint by itself; rank 0 then writes the final
weights (OUT.npz) and what it resumed from (OUT.json).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import elastic  # noqa: E402
import mpicomm  # noqa: E402
from elastic_job_lib import LR, local_loss, make_model  # noqa: E402
from mpicomm import distributed as mdist  # noqa: E402
from zero import ZeroOptimizer  # noqa: E402


def main() -> None:
    opt_kind, ckdir, steps, victim, kill_step, out = sys.argv[1:7]
    steps, victim, kill_step = int(steps), int(victim), int(kill_step)
    torch.set_num_threads(1)
    world = mpicomm.init()
    mdist.init_process_group()
    model = make_model()
    if opt_kind == "ddp":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    else:
        opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=2, comm=world.dup(), lr=LR)
    state = elastic.TorchState(model=model, optimizer=opt, comm=world if opt_kind == "ddp" else None,
                               checkpoint_dir=ckdir, checkpoint_every=2, step=0)

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        net = DDP(model) if opt_kind == "ddp" else model
        while state.step < steps:
            if state.step == kill_step and world.rank == victim:
                os._exit(9)
            opt.zero_grad()
            local_loss(net, state.step, state.rank, state.world_size).backward()
            opt.step()
            state.step += 1
            state.commit()

    train(state)
    if state.rank == 0:
        np.savez(out + ".npz", **{f"p{i}": p.detach().numpy() for i, p in enumerate(model.parameters())})
        with open(out + ".json", "w") as f:
            json.dump({"resumed": state.resumed, "world_size": state.world_size, "commits": state.commits}, f)
    import torch.distributed as dist
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
