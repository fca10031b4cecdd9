"""Disk checkpoint job for tests/test_elastic_restart.py and test_elastic_faults.py: train under
elastic.run with a checkpoint every 2 commits.

    mpiexec [--with-ft ulfm] -n N python tests/elastic_disk_job.py OPT DIR STEPS KILL KILL_STEP OUT [MODE]

OPT: ddp | zero2 | fsdp2 (``fully_shard`` per layer and at the root, rebuilt by
elastic.RebuildFSDP after a recovery); all with Adam; DIR: checkpoint_dir; KILL: world ranks
(comma-separated, -1: nobody) that die (SIGKILL) at the start of step KILL_STEP. MODE, several
joined by ``+``: ``insave``: they die inside the background write of the checkpoint taken at
commit KILL_STEP instead; ``again:R``: world rank R dies too, inside the recovery, right after
its first shrink; ``then:R:S``: world rank R dies too, at the start of step S; ``min:M``:
``elastic.run(min_world_size=M)``; ``domains:K``: ranks in blocks of K share a failure domain,
as ranks on one host do (``TorchState(failure_domain=...)``); ``badreset``: a reset callback
raises. Without ULFM the launcher then ends the whole job, and a relaunch resumes from DIR's
newest checkpoint by itself; under ULFM the survivors recover from their in-memory commits, or
from DIR's newest checkpoint when a shard was lost with its replica. Rank 0 writes the final
weights (OUT.npz) and what happened (OUT.json).
"""
from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import elastic  # noqa: E402
import mpicomm  # noqa: E402
from elastic_job_lib import LR, local_loss, make_model  # noqa: E402
from mpicomm import distributed as mdist  # noqa: E402
from zero import ZeroOptimizer  # noqa: E402


def die() -> None:
    """End this process as an OOM kill or a crash would. (Open MPI 5.0.11's launcher, under
    ULFM, ended the whole job when a second rank exited with a non-zero status, e.g. os._exit(9);
    ranks killed by a signal were survived.)"""
    os.kill(os.getpid(), signal.SIGKILL)


def build_fsdp2() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model sharded over the ranks there are now, and its Adam (also after a recovery)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def main() -> None:
    opt_kind, ckdir, steps, kill, kill_step, out = sys.argv[1:7]
    steps, victims, kill_step = int(steps), [int(v) for v in kill.split(",")], int(kill_step)
    torch.set_num_threads(1)
    world = mpicomm.init()
    mdist.init_process_group()
    modes = (sys.argv[7] if len(sys.argv) > 7 else "").split("+")
    block = next((int(m[8:]) for m in modes if m.startswith("domains:")), None)
    model = make_model()
    if opt_kind == "ddp":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    elif opt_kind == "fsdp2":
        model, opt = build_fsdp2()
    else:
        opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=2, comm=world.dup(), lr=LR)
    state = elastic.TorchState(model=model, optimizer=opt, comm=None if opt_kind == "zero2" else world,
                               checkpoint_dir=ckdir, checkpoint_every=2, step=0,
                               failure_domain=None if block is None else f"host{world.rank // block}")
    if opt_kind == "fsdp2":
        state.register_reset_callbacks([elastic.RebuildFSDP(state, build_fsdp2)])
    mode = modes[0]
    later = {int(m.split(":")[2]): int(m.split(":")[1]) for m in modes if m.startswith("then:")}
    min_world = next((int(m[4:]) for m in modes if m.startswith("min:")), 1)
    if mode == "insave" and world.rank in victims:
        import ckpt.api
        import ckpt.direct_io
        import ckpt.io
        import ckpt.posix_io

        write, write_round, doomed = ckpt.api.write_items, ckpt.io._round, f".step{kill_step}.tmp"

        def write_then_die(mpi_comm, filename, *a, **k):
            if doomed in filename:   # inside the write of that checkpoint's data file: its
                # collective MPI-IO rounds, its O_DIRECT writes where the file system takes them,
                # or its per-rank POSIX writes (the path taken under ULFM)
                ckpt.io._round = lambda *a, **k: die()
                ckpt.direct_io.write = lambda *a, **k: die()
                ckpt.posix_io.write = lambda *a, **k: die()
            return write(mpi_comm, filename, *a, **k)
        ckpt.api.write_items = write_then_die
        kill_step = -1
    if mode.startswith("again:") and world.rank == int(mode[6:]):
        shrink = mpicomm.Communicator.shrink

        def shrink_then_die(self):
            shrink(self)
            die()
        mpicomm.Communicator.shrink = shrink_then_die
    if mode == "badreset":
        def rebuild_data_loader() -> None:
            raise OSError("no data shard for the new world size")
        state.register_reset_callbacks([rebuild_data_loader])

    @elastic.run(min_world_size=min_world)
    def train(state: elastic.TorchState) -> None:
        net = DDP(model) if opt_kind == "ddp" else state.model    # FSDP2: the rebuilt one after a recovery
        optim = state.optimizer
        while state.step < steps:
            if state.step == kill_step and world.rank in victims or later.get(state.step) == world.rank:
                die()
            optim.zero_grad()
            local_loss(net, state.step, state.rank, state.world_size).backward()
            optim.step()
            state.step += 1
            state.commit()

    train(state)
    weights = {f"p{i}": (p.full_tensor() if opt_kind == "fsdp2" else p).detach().numpy()
               for i, p in enumerate(state.model.parameters())}    # full_tensor(): collective
    if state.rank == 0:
        np.savez(out + ".npz", **weights)
        with open(out + ".json", "w") as f:
            json.dump({"resumed": state.resumed, "world_size": state.world_size, "stride": state.replica_stride,
                       "dist_world_size": dist.get_world_size(), "commits": state.commits,
                       "recoveries": state.recoveries}, f)
    dist.destroy_process_group()
    if state.recoveries:
        # as in elastic_job.py: after a rank failure MPI_Finalize sometimes hung (Open MPI 5.0.11 ULFM)
        state.comm.barrier()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
