"""A Horovod-style elastic job on mpicomm.horovod under ``mpirun --with-ft ulfm``: rank VICTIM
os._exit(9)s at step STEP (WHERE: between steps, or inside backward while the gradient
allreduces are in flight); the survivors go on from the last commit. Rank 0 writes its final
weights and the recoveries to OUT.npz / OUT.json.

    python -m mpi4py tests/horovod_elastic_job.py WHERE VICTIM STEP STEPS OUT
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

import mpicomm.horovod as hvd
from elastic_job_lib import LR, local_loss, make_model


def main() -> None:
    where, victim, kill_step, steps, out = sys.argv[1:6]
    victim, kill_step, steps = int(victim), int(kill_step), int(steps)
    hvd.init()
    me = hvd.rank()
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    state = hvd.elastic.TorchState(model, opt, step=0)

    def die_in_backward(p):
        if where == "backward" and me == victim and state.step == kill_step:
            os._exit(9)

    list(model.parameters())[0].register_post_accumulate_grad_hook(die_in_backward)

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            if where == "between" and me == victim and state.step == kill_step:
                os._exit(9)
            opt.zero_grad()
            local_loss(model, state.step, hvd.rank(), hvd.size()).backward()
            opt.step()
            state.step += 1
            state.commit()

    train(state)
    if hvd.rank() == 0:
        np.savez(out + ".npz", **{f"p{i}": p.detach().numpy() for i, p in enumerate(model.parameters())})
        with open(out + ".json", "w") as f:
            json.dump({"size": hvd.size(), "recoveries": len(state.recoveries)}, f)
    hvd.barrier()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # as tests/elastic_job.py: MPI_Finalize after a failure may hang (Open MPI 5, ULFM)


if __name__ == "__main__":
    main()
