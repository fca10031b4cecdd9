"""The job of ``python -m bench elastic --soak`` (bench/elastic_soak.py): train for a while under
elastic.run, a rank SIGKILLed every ``kill_every`` seconds.

    mpirun --with-ft ulfm -n 4 python -m mpi4py bench/elastic_soak_job.py CONFIG_JSON OUT_DIR

CONFIG: ``mode`` (ddp | zero2 | zero2-mpi), ``seconds`` (training time; every step agrees on
stopping, so every rank does the same steps), ``kill_every`` (0: no kills), ``width`` and
``layers`` (the MLP), ``batch`` (the global batch). Kill k (k = seconds since the common start //
kill_every, by the latest clock of the ranks, agreed at every step's start) takes the rank whose
current rank is k modulo the world size, at that step's start: one rank per kill;
without growth (``elastic.run`` taking no ``max_world_size``) nobody dies below 2 ranks. Every
survivor writes OUT_DIR/rank<R>.json (steps, training seconds, recoveries, growths, its steps
per 0.25 s) and rank<R>.npz; a victim writes its steps per 0.25 s to OUT_DIR/timeline-<pid>.json
before it dies.
"""
from __future__ import annotations

import inspect
import json
import os
import signal
import sys
import time

import numpy as np
import torch

# run as a script, bench/ is sys.path[0]: the repository's elastic, not bench/elastic.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import elastic  # noqa: E402
import mpicomm  # noqa: E402

SAMPLES, LR = 4096, 1e-3
BIN = 0.25     # seconds a bin of the step timeline spans


def make_model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods[:-1])


def data(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(SAMPLES, width, generator=g), 0.5 * torch.randn(SAMPLES, width, generator=g)


def sampler(batch: int) -> elastic.ElasticSampler:
    return elastic.ElasticSampler(SAMPLES, batch, seed=5)


def reference(cfg: dict, steps: int) -> list[np.ndarray]:
    """Final weights of one plain torch process (Adam) after ``steps`` steps on the same global batches."""
    model = make_model(cfg["width"], cfg["layers"])
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = data(cfg["width"])
    s = sampler(cfg["batch"])
    for step in range(steps):
        idx = s.global_indices(step)
        loss = ((model(x[idx]) - y[idx]) ** 2).sum() / cfg["batch"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def growth() -> bool:
    """Whether ``elastic.run`` takes ``max_world_size`` (spawns replacements after a loss)."""
    return "max_world_size" in inspect.signature(elastic.run).parameters


def main() -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mpicomm import distributed as mdist
    from zero import ZeroOptimizer

    cfg, out = json.loads(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    if cfg["mode"].endswith("-mpi"):
        os.environ[elastic.shm.ENV] = "0"
    world = mpicomm.init()
    mdist.init_process_group()
    grows = growth() and cfg.get("grow", True)
    newcomer = grows and elastic.grow.joining()        # spawned by the job growing back: joins in elastic.run
    start = 0.0 if newcomer else world.mpi_comm.bcast(time.time() + 1.0, root=0)     # one host: one clock
    model = make_model(cfg["width"], cfg["layers"])
    if cfg["mode"] == "ddp":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        state = elastic.TorchState(model=model, optimizer=opt, comm=world, step=0, start=start)
    else:
        opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=2, comm=world.dup(), lr=LR)
        state = elastic.TorchState(model=model, optimizer=opt, step=0, start=start)
    x, y = data(cfg["width"])
    s = sampler(cfg["batch"])
    kw = {"max_world_size": 4, "wait_for_replacements": bool(cfg.get("join_wait"))} if grows else {}
    if cfg.get("spare"):
        kw["spare"] = True      # a replacement started ahead, waiting to join after a loss
    ended: list[float] = []     # when train() saw the window end (a spare starting may then take a while to leave)
    seen: list[int | None] = [None]     # the last kill this rank saw come due (a newcomer: the current one)
    bins: dict[int, int] = {}           # steps ended per BIN seconds of the common window

    @elastic.run(**kw)
    def train(state: elastic.TorchState) -> None:
        net = DDP(model) if cfg["mode"] == "ddp" else model
        while True:
            # every rank reads the same clock at the same step (the latest of theirs), so kill k comes
            # due at one step everywhere: a rank that saw it only after the recovery would kill again
            now = torch.tensor([time.time() - state.start], dtype=torch.float64)
            state.comm.all_reduce(now, op=mpicomm.ReduceOp.MAX)
            if now.item() >= cfg["seconds"]:
                ended.append(time.time())
                return
            k = int(now.item() // cfg["kill_every"]) if cfg["kill_every"] > 0 else 0
            if seen[0] is None:
                seen[0] = k
            if k > seen[0]:
                seen[0] = k
                if (grows or state.world_size > 2) and state.rank == k % state.world_size:
                    with open(os.path.join(out, f"timeline-{os.getpid()}.json"), "w") as f:
                        json.dump({"bin_s": BIN, "steps": bins}, f)     # the victim's steps, for the bench
                    sys.stdout.flush(), sys.stderr.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
            idx = s.local_indices(state.step, state.rank, state.world_size)
            opt.zero_grad()
            (s.loss_scale(state.world_size) * ((net(x[idx]) - y[idx]) ** 2).sum()).backward()
            opt.step()
            state.step += 1
            state.commit()
            b = int((time.time() - state.start) / BIN)
            bins[b] = bins.get(b, 0) + 1

    while time.time() < start:
        time.sleep(0.01)
    train(state)
    seconds = ended[-1] - state.start     # the common window (a newcomer has state.start from its commit)
    me = state.rank      # (a newcomer's world rank is 0 of its own world)
    np.savez(os.path.join(out, f"rank{me}.npz"), **{f"p{i}": p.detach().numpy() for i, p in enumerate(model.parameters())})
    with open(os.path.join(out, f"rank{me}.json"), "w") as f:
        json.dump({"steps": int(state.step), "seconds": seconds, "world_size": state.world_size, "growth": grows, "newcomer": newcomer,
                   "recoveries": state.recoveries, "growths": state.growths,
                   "timeline": {"bin_s": BIN, "steps": bins}}, f, default=repr)
    torch.distributed.destroy_process_group()
    state.comm.barrier()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)     # as tests/elastic_job.py: after a failure MPI_Finalize sometimes hung (Open MPI 5.0.11, ULFM)


if __name__ == "__main__":
    main()
