"""One chaos trial for ``python -m bench elastic --chaos`` (bench/elastic_chaos.py) and
tests/test_elastic_chaos.py: train under elastic.run while ranks die at random moments.

    mpirun --with-ft ulfm -n 4 python -m mpi4py tests/elastic_chaos_job.py PLAN_JSON OUT_DIR

PLAN_JSON (made by bench.elastic_chaos.plan from a seed): ``mode`` (ddp | zero1 | zero2 |
zero1-mpi | zero2-mpi: ZeroOptimizer stage 1/2, the -mpi ones with MPICOMM_ELASTIC_SHM=0 |
fsdp2: fully_shard + elastic.RebuildFSDP), ``steps``, ``sched`` (a StepLR kept as a committed
attribute), ``ckpt`` (checkpoint_dir with checkpoint_every=2), ``victim`` (world rank) that
``os._exit(9)``s from a timer thread ``frac`` of its previous step's duration after the start
of step ``step`` (step -1: ``frac`` x 0.05 s after ``train`` is first called, inside the first
commit or step), and ``second`` (None, or ``{"rank", "where", "delay"}``: that rank is
SIGKILLed inside the recovery: ``timer`` (``delay`` s after ``elastic.run``'s recovery starts
there), ``shrink`` (right after its shrink), ``rollback`` (entering the rollback, after the
rebind), ``callback`` (in the last reset callback)), and ``grow`` (none | grow: elastic.run(
max_world_size=4), the job grows back after a loss and waits at the end until no growth is
under way | spare: the same with spare=True, and the ranks wait until the spare is ready before
training, so the loss finds it so). A second victim is killed by a signal,
not ``os._exit``: Open MPI 5.0.11's launcher ends the whole job when a second rank exits with
an error status (docs/elastic.md, Limits).

Every rank writes OUT_DIR/rank<R>.log (its stdout and stderr; a replacement new<PID>.log, and its
other files so named too); a victim writes victim<R>.json
just before it dies (where it was); every survivor writes rank<R>.json (``done`` with its
final step and recoveries, or ``error`` with the exception's type, whether it is an
elastic.ElasticError, and its message) and, when done, rank<R>.npz (its full final weights).
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback

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

#: the learning-rate schedule of a plan with ``sched`` (the reference uses the same)
SCHED_STEP, SCHED_GAMMA = 3, 0.5


class Killer:
    """Kills this process once, unless training already ended (then it does nothing)."""

    def __init__(self, out: str, me: int) -> None:
        self.out, self.me, self.lock, self.finished = out, me, threading.Lock(), False
        self.phase, self.step = "setup", -1

    def die(self, what: str, signal_kill: bool) -> None:
        with self.lock:         # held while dying: training cannot end meanwhile
            if self.finished:
                return
            with open(os.path.join(self.out, f"victim{self.me}.json"), "w") as f:
                json.dump({"what": what, "phase": self.phase, "step": self.step, "t": time.time()}, f)
            sys.stdout.flush(), sys.stderr.flush()
            if signal_kill:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(9)

    def after(self, delay: float, what: str, signal_kill: bool = False) -> None:
        t = threading.Timer(max(0.0, delay), self.die, (what, signal_kill))
        t.daemon = True
        t.start()

    def end(self) -> None:
        with self.lock:
            self.finished = True


def build_fsdp2() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model sharded over the ranks there are now, and its Adam (also after a recovery)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def main() -> None:
    plan, out = json.loads(sys.argv[1]), sys.argv[2]
    mode, steps = plan["mode"], int(plan["steps"])
    torch.set_num_threads(1)
    if mode.endswith("-mpi"):
        os.environ[elastic.shm.ENV] = "0"
    world = mpicomm.init()
    joined = elastic.grow.joining()     # a replacement spawned by the job growing back
    me = world.rank if not joined else -1
    name = f"rank{me}" if not joined else f"new{os.getpid()}"
    log = os.open(os.path.join(out, f"{name}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1), os.dup2(log, 2)
    killer = Killer(out, me)
    second = plan.get("second") if plan.get("second") and plan["second"]["rank"] == me else None
    armed = {"first": False, "second": False}

    mdist.init_process_group()
    model = make_model()
    if mode == "ddp":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    elif mode == "fsdp2":
        model, opt = build_fsdp2()
    else:
        opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=int(mode[4]), comm=world.dup(), lr=LR,
                            bucket_bytes=64)
    attrs = {"step": 0}
    if plan.get("sched"):
        attrs["sched"] = torch.optim.lr_scheduler.StepLR(opt, step_size=SCHED_STEP, gamma=SCHED_GAMMA)
    ckdir = os.path.join(out, "ck") if plan.get("ckpt") else None
    state = elastic.TorchState(model=model, optimizer=opt, comm=None if mode.startswith("zero") else world,
                               checkpoint_dir=ckdir, checkpoint_every=2 if ckdir else None, **attrs)
    if mode == "fsdp2":
        state.register_reset_callbacks([elastic.RebuildFSDP(state, build_fsdp2)])

    # the second victim: inside elastic.run's recovery (entered through elastic.run.recover)
    run_mod = importlib.import_module("elastic.run")
    recover = run_mod.recover

    def recover_watched(*a, **k):
        killer.phase = "recovery"
        if second is not None and not armed["second"]:
            armed["second"] = True
            where = second["where"]
            if where == "timer":
                killer.after(second["delay"], "second:timer", True)
            elif where == "shrink":
                shrink = mpicomm.Communicator.shrink

                def shrink_then_die(self):
                    new = shrink(self)
                    killer.die("second:shrink", True)
                    return new
                mpicomm.Communicator.shrink = shrink_then_die
            elif where == "rollback":
                rollback = type(state)._rollback

                def rollback_then_die(self, *ra, **rk):
                    killer.die("second:rollback", True)
                    return rollback(self, *ra, **rk)
                type(state)._rollback = rollback_then_die
        try:
            return recover(*a, **k)
        finally:
            killer.phase = "training"
    run_mod.recover = recover_watched
    if second is not None and second["where"] == "callback":
        state.register_reset_callbacks([lambda: killer.die("second:callback", True)])

    durations: list[float] = []
    grow = plan.get("grow", "none")

    def wait_for_the_spare() -> None:    # (a peek at elastic's internals: the spare's message, not received)
        p = state._growing
        while p is not None and not p.merged.Iprobe(source=p.old_world, tag=elastic.grow.READY_TAG):
            time.sleep(0.05)

    # (world.size is 1 in a replacement: it takes the job's settings when it joins)
    @elastic.run(max_world_size=None if grow == "none" else world.size, spare=grow == "spare")
    def train(state: elastic.TorchState) -> None:
        killer.phase = "training"
        net = DDP(model) if mode == "ddp" else state.model     # FSDP2: the rebuilt one after a recovery
        optim = state.optimizer
        while state.step < steps:
            t0 = time.perf_counter()
            killer.step = state.step
            if me == plan["victim"] and not armed["first"] and state.step == plan["step"]:
                armed["first"] = True
                killer.after(plan["frac"] * durations[-1], f"first:step{state.step}")
            optim.zero_grad()
            local_loss(net, state.step, state.rank, state.world_size).backward()
            optim.step()
            if plan.get("sched"):
                state.sched.step()
            state.step += 1
            state.commit()
            durations.append(time.perf_counter() - t0)
            if grow == "spare" and state.step == 1 and me >= 0 and not armed["first"]:
                wait_for_the_spare()        # (started at this commit; the first loss comes after it)
        while state.growing:    # a growth under way ends before the job does (joined or given up)
            time.sleep(0.05)
            state.commit()

    status: dict = {"rank": me}
    try:
        if me == plan["victim"] and plan["step"] < 0:
            armed["first"] = True
            killer.after(plan["frac"] * 0.05, "first:start")
        train(state)
    except Exception as e:  # noqa: BLE001 - written down for the driver, which classifies it
        killer.end()
        status.update(status="error", type=type(e).__name__, elastic=isinstance(e, elastic.ElasticError),
                      msg=str(e)[:3000], tb=traceback.format_exc()[-4000:])
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(status, f)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(3)
    killer.end()
    params = list(state.model.parameters())
    weights = {f"p{i}": (p.full_tensor() if mode == "fsdp2" else p).detach().numpy() for i, p in enumerate(params)}
    np.savez(os.path.join(out, f"{name}.npz"), **weights)
    status.update(status="done", step=int(state.step), world_size=state.world_size, rank_now=state.rank,
                  recoveries=state.recoveries, growths=state.growths,
                  lr=[g["lr"] for g in state.optimizer.param_groups])
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(status, f, default=repr)
    dist.destroy_process_group()
    state.comm.barrier()
    # as tests/elastic_job.py: after a rank failure MPI_Finalize sometimes hung (Open MPI 5.0.11, ULFM)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
