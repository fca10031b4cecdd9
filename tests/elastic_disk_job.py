"""Disk checkpoint job for tests/test_elastic_restart.py and test_elastic_faults.py: train under
elastic.run with a checkpoint every 2 commits.

    mpiexec [--with-ft ulfm] -n N python tests/elastic_disk_job.py OPT DIR STEPS KILL KILL_STEP OUT [badreset]

OPT: ddp | zero2; DIR: checkpoint_dir; KILL: world ranks (comma-separated, -1: nobody) that die
with os._exit(9) at the start of step KILL_STEP. Without ULFM the launcher then ends the whole
job, and a relaunch resumes from DIR's newest checkpoint by itself; under ULFM the survivors
recover from their in-memory commits (a shard lost with its replica still ends the job: there is
no disk fall-back yet). ``badreset``: a reset callback raises. Rank 0 writes the final weights (OUT.npz) and what happened (OUT.json).
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
    opt_kind, ckdir, steps, kill, kill_step, out = sys.argv[1:7]
    steps, victims, kill_step = int(steps), [int(v) for v in kill.split(",")], int(kill_step)
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
    if sys.argv[7:] == ["badreset"]:
        def rebuild_data_loader() -> None:
            raise OSError("no data shard for the new world size")
        state.register_reset_callbacks([rebuild_data_loader])

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        net = DDP(model) if opt_kind == "ddp" else model
        while state.step < steps:
            if state.step == kill_step and world.rank in victims:
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
            json.dump({"resumed": state.resumed, "world_size": state.world_size, "commits": state.commits,
                       "recoveries": state.recoveries}, f)
    import torch.distributed as dist
    dist.destroy_process_group()
    if state.recoveries:
        # as in elastic_job.py: after a rank failure MPI_Finalize sometimes hung (Open MPI 5.0.11 ULFM)
        state.comm.barrier()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
