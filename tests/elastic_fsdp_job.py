"""Fault-injection job for tests/test_elastic_fsdp_faults.py: an FSDP2 model (``fully_shard``
per layer and at the root) with AdamW trains under elastic.run; one rank dies.

    mpirun --with-ft ulfm -n N python tests/elastic_fsdp_job.py WHERE RANK STEP STEPS OUT [grow=N]

WHERE: none | between (after the commit of step STEP) | backward (inside backward, after the
last layer's gradient reduce-scatter was issued, before the first layer's) | ostep (inside
optimizer.step, in its pre-hook: gradients reduced, no weight updated yet) | commit (inside
commit(), right after the packed shards' send to the buddy was issued); RANK: the world rank
that os._exit(9)s at step STEP. grow=N: elastic.run(max_world_size=N): a replacement is spawned
after the loss, gets its FSDP2 shards from the live ranks and trains. The new rank 0 writes the final full weights (OUT.npz) and what
happened (OUT.json) for the test to compare with a single-process reference.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import elastic  # noqa: E402
import mpicomm  # noqa: E402
from elastic_job_lib import LR, local_loss, make_model  # noqa: E402
from mpicomm import distributed as mdist  # noqa: E402


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model sharded over the ranks there are now, and its AdamW (also after a recovery)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def main() -> None:
    where, victim, kill_step, steps, out = sys.argv[1:6]
    victim, kill_step, steps = int(victim), int(kill_step), int(steps)
    opts = dict(a.split("=", 1) for a in sys.argv[6:])
    grow_to = int(opts["grow"]) if "grow" in opts else None
    torch.set_num_threads(1)
    world = mpicomm.init()
    joined = elastic.grow.joining()      # a replacement spawned by the growing job
    me = world.rank if not joined else -1    # the original rank: the victim is named by it

    def die(at: str) -> None:
        if where == at and me == victim:
            os._exit(9)

    mdist.init_process_group()
    model, opt = build()
    state = elastic.TorchState(model=model, optimizer=opt, comm=world, step=0)
    state.register_reset_callbacks([elastic.RebuildFSDP(state, build)])
    if where == "backward":
        # at the Tanh's output gradient: the last layer's reduce-scatter is issued, the first layer's not
        def watch(mod: torch.nn.Module, inp: tuple, out: torch.Tensor) -> None:
            out.register_hook(lambda g: die("backward" if state.step == kill_step else ""))
        model[1].register_forward_hook(watch)
    if where == "ostep":
        opt.register_step_pre_hook(lambda *_: die("ostep" if state.step == kill_step else ""))
    if where == "commit":
        def isend_then_die(*a, **k):
            work = type(world).isend(world, *a, **k)
            die("commit" if state.step == kill_step + 1 else "")
            return work
        world.isend = isend_then_die     # state.comm until the recovery

    @elastic.run(max_world_size=grow_to)
    def train(state: elastic.TorchState) -> None:
        net, optim = state.model, state.optimizer
        while state.step < steps:
            optim.zero_grad()
            local_loss(net, state.step, state.rank, state.world_size).backward()
            optim.step()
            state.step += 1
            state.commit()
            die("between" if state.step == kill_step + 1 else "")
        while state.growing:        # replacements start while the job trains: commits until they joined
            time.sleep(0.05)
            state.commit()

    train(state)
    weights = {f"p{i}": p.full_tensor().detach().numpy() for i, p in enumerate(state.model.parameters())}
    if state.rank == 0:
        np.savez(out + ".npz", **weights)
        with open(out + ".json", "w") as f:
            json.dump({"world_size": state.world_size, "dist_world_size": dist.get_world_size(),
                       "mesh_size": next(state.model.parameters()).device_mesh.size(),
                       "recoveries": state.recoveries, "growths": state.growths}, f)
    dist.destroy_process_group()
    state.comm.barrier()
    # as tests/elastic_job.py: after a rank failure MPI_Finalize sometimes hung (Open MPI 5.0.11, ULFM)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
