"""Workers of ``python -m bench elastic --peers`` (bench/elastic_peers.py): the same MLP, Adam,
4 workers, worker 1 ``os._exit(9)``s at the start of step ``kill_step`` (or in its backward:
``kill_at`` in CONFIG), in one of three systems:

    ours      mpirun --with-ft ulfm -n 4 python -m mpi4py bench/elastic_peers_job.py ours CONFIG OUT
              elastic.run, committing every step (``ours`` in CONFIG: ddp, or zero2: a
              ZeroOptimizer stage 2 replicated by state, through shared memory on one host;
              ``grow`` in CONFIG: elastic.run(max_world_size=4), a replacement spawned after
              the loss; ``"spare"``: elastic.run(max_world_size=4, spare=True), the spare
              spawned at the first commit and the ranks waiting until it is ready before step 2)
    torchft   python bench/elastic_peers_job.py torchft CONFIG OUT REPLICA LIGHTHOUSE
              one torchft 0.2 replica group of one process (Manager, its Optimizer wrapper,
              ProcessGroupGloo, each gradient through Manager.allreduce), all on loopback
    torchrun  torchrun --standalone --nproc-per-node 4 --max-restarts 1 bench/elastic_peers_job.py torchrun CONFIG OUT
              DDP over gloo, a torch.distributed.checkpoint (DCP) save after every step, every
              worker restarted from the newest one after the failure

Each worker appends JSON lines to OUT/events<R>.jsonl: ``step`` (its start and end wall times,
the time of its fault-tolerance part: ours the commit, torchft its quorum and should_commit,
torchrun the DCP save; whether it counted), ``death`` (the victim), ``failed`` (a survivor saw
the failure: ours the recovery's start, torchft a step not committed), ``term`` (torchrun's
agent stopping a survivor).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Events:
    def __init__(self, out: str, rank: int) -> None:
        self.path = os.path.join(out, f"events{rank}.jsonl")

    def put(self, ev: str, **kw) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"ev": ev, "t": time.time(), **kw}) + "\n")


def _dies(cfg: dict, where: str) -> bool:
    """Whether the victim dies ``where`` ("start" of its step, or in "backward"): cfg "kill_at"."""
    return cfg.get("kill_at", "start") == where


def _die_in_backward(cfg: dict, model: torch.nn.Module, ev: Events, now) -> None:
    """With kill_at "backward": ``os._exit(9)`` when the first weight's gradient is ready (it
    comes last in backward: the other gradients' reductions are under way) and ``now()``."""
    def hook(_p: torch.Tensor) -> None:
        if now():
            ev.put("death")
            os._exit(9)
    if _dies(cfg, "backward"):
        list(model.parameters())[0].register_post_accumulate_grad_hook(hook)


def _batch(cfg: dict, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(cfg["batch"], cfg["width"], generator=g)


def ours(cfg: dict, out: str) -> None:
    import elastic
    import mpicomm
    from bench.elastic import make_model
    from mpicomm import distributed as mdist
    from zero import ZeroOptimizer

    world = mpicomm.init()
    mdist.init_process_group()
    joined = elastic.grow.joining()     # a replacement spawned by the job growing back (cfg "grow")
    me = world.rank if not joined else -1
    ev = Events(out, world.rank if not joined else 1000 + os.getpid())
    model = make_model(cfg["params"], cfg["width"])
    if cfg["ours"] == "ddp":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        state = elastic.TorchState(model=model, optimizer=opt, comm=world, step=0)
    else:
        opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=2, comm=world.dup(), lr=1e-4)
        state = elastic.TorchState(model=model, optimizer=opt, step=0)
    seen = [0, 0]
    _die_in_backward(cfg, model, ev, lambda: me == 1 and state.step == cfg["kill_step"])

    def wait_for_the_spare() -> None:    # (a peek at elastic's internals: the spare's message, not received)
        p = state._growing
        while p is not None and not p.merged.Iprobe(source=p.old_world, tag=elastic.grow.READY_TAG):
            time.sleep(0.05)

    @elastic.run(max_world_size=cfg["workers"] if cfg.get("grow") else None, spare=cfg.get("grow") == "spare")
    def train(state: elastic.TorchState) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if len(state.recoveries) > seen[0]:
            seen[0] = len(state.recoveries)
            ev.put("failed", at=state.recoveries[-1]["started_at"], recover_s=state.recoveries[-1]["recover_s"])
        if len(state.growths) > seen[1]:
            seen[1] = len(state.growths)
            ev.put("grown", **{k: v for k, v in state.growths[-1].items() if k != "note"})
        net = DDP(model) if cfg["ours"] == "ddp" else model
        while state.step < cfg["steps"]:
            if me == 1 and state.step == cfg["kill_step"] and _dies(cfg, "start"):
                ev.put("death")
                os._exit(9)
            t0 = time.time()
            opt.zero_grad()
            net(_batch(cfg, state.rank, state.step)).square().mean().backward()
            opt.step()
            state.step += 1
            t1, world = time.time(), state.world_size
            try:
                state.commit()
            except elastic.grow.Regrouped:      # (elastic's signal, a peek: the step counted, and then
                end = time.time() - state.growths[-1].get("join_s", 0.0)   # replacements joined at its commit)
                ev.put("step", step=state.step - 1, t0=t0, t1=end, ft_s=end - t1, counted=True, world=world)
                raise
            ev.put("step", step=state.step - 1, t0=t0, t1=time.time(), ft_s=time.time() - t1, counted=True,
                   world=state.world_size)
            if cfg.get("grow") == "spare" and state.step == 1 and not joined:
                wait_for_the_spare()        # (spawned at this commit; ready before the loss)

    train(state)
    torch.distributed.destroy_process_group()
    state.comm.barrier()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)     # as tests/elastic_job.py: after a failure MPI_Finalize sometimes hung (Open MPI 5.0.11, ULFM)


def torchft_worker(cfg: dict, out: str, replica: int, lighthouse: str) -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo

    from bench.elastic import make_model

    ev = Events(out, replica)
    model = make_model(cfg["params"], cfg["width"])
    inner = torch.optim.Adam(model.parameters(), lr=1e-4)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    open(os.path.join(out, f"ready{replica}"), "w").close()
    while sum(os.path.exists(os.path.join(out, f"ready{r}")) for r in range(cfg["workers"])) < cfg["workers"]:
        time.sleep(0.01)    # all Managers start together: the first quorum holds every replica

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"peer{replica}",
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=lighthouse, hostname="127.0.0.1", timeout=timedelta(seconds=10))
    # torchft's own DistributedDataParallel is not used: when a peer dies during the step, its comm
    # hook fails (`assert fut._fut`: the failed allreduce never set its future) instead of letting
    # the step be discarded. Each gradient goes through Manager.allreduce as it is ready (its
    # PureDistributedDataParallel), and the step waits on them all after backward.
    works: list = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: works.append(manager.allreduce(p.grad)))
    opt = Optimizer(manager, inner)
    update = inner.step
    spent = [0.0]

    def timed_update(*a, **k):
        t = time.perf_counter()
        try:
            return update(*a, **k)
        finally:
            spent[0] = time.perf_counter() - t
    inner.step = timed_update
    # killed inside a quorum of 3 or more (the replicas join quorums one by one at the start)
    _die_in_backward(cfg, model, ev, lambda: replica == 1 and manager.current_step() >= cfg["kill_step"]
                     and manager.num_participants() >= cfg["workers"] - 1)
    while manager.current_step() < cfg["steps"]:
        step = manager.current_step()
        if replica == 1 and step >= cfg["kill_step"] and manager.num_participants() >= cfg["workers"] - 1 \
                and _dies(cfg, "start"):
            ev.put("death")
            os._exit(9)
        t0 = time.time()
        spent[0] = 0.0
        a = time.perf_counter()
        opt.zero_grad()                     # starts the quorum
        z = time.perf_counter() - a
        model(_batch(cfg, replica, step)).square().mean().backward()
        for work in works:
            work.wait()                     # a failure is reported to the manager: the step is not committed
        works.clear()
        a = time.perf_counter()
        opt.step()                          # should_commit, then the update where it counts
        s = time.perf_counter() - a
        counted = manager.current_step() > step
        if not counted:
            ev.put("failed")
        ev.put("step", step=step, t0=t0, t1=time.time(), ft_s=z + s - spent[0], counted=counted,
               world=manager.num_participants())
    manager.shutdown(wait=False)
    os._exit(0)


def torchrun_worker(cfg: dict, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench.elastic import make_model

    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # the launcher's store under a prefix per attempt: gloo's addresses of the failed attempt are
    # still in it (torch 2.13: the restarted workers otherwise connected to the dead ones)
    store = dist.PrefixStore(f"attempt{attempt}/", dist.TCPStore(os.environ["MASTER_ADDR"],
                                                                 int(os.environ["MASTER_PORT"]), is_master=False))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    ev = Events(out, rank)
    signal.signal(signal.SIGTERM, lambda *_: (ev.put("term"), os._exit(1)))
    model = make_model(cfg["params"], cfg["width"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    net = DDP(model)
    ckdir = os.path.join(out, "dcp")
    latest = os.path.join(ckdir, "latest")
    step = 0
    if os.path.exists(latest):
        with open(latest) as f:
            step = int(f.read())
        msd, osd = get_state_dict(net, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=os.path.join(ckdir, f"step{step}"))
        set_state_dict(net, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        ev.put("loaded", step=step, attempt=attempt)
    at = [step]
    _die_in_backward(cfg, net, ev, lambda: rank == 1 and at[0] == cfg["kill_step"] and attempt == 0)
    while step < cfg["steps"]:
        at[0] = step
        if rank == 1 and step == cfg["kill_step"] and attempt == 0 and _dies(cfg, "start"):
            ev.put("death")
            os._exit(9)
        t0 = time.time()
        opt.zero_grad()
        net(_batch(cfg, rank, step)).square().mean().backward()
        opt.step()
        step += 1
        t1 = time.time()
        msd, osd = get_state_dict(net, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(ckdir, f"step{step}"))
        dist.barrier()
        if rank == 0:
            with open(latest + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(latest + ".tmp", latest)
            shutil.rmtree(os.path.join(ckdir, f"step{step - 2}"), ignore_errors=True)
        ev.put("step", step=step - 1, t0=t0, t1=time.time(), ft_s=time.time() - t1, counted=True,
               world=dist.get_world_size(), attempt=attempt)
    dist.destroy_process_group()


def main() -> None:
    kind, cfg, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    if kind == "ours":
        ours(cfg, out)
    elif kind == "torchft":
        torchft_worker(cfg, out, int(sys.argv[4]), sys.argv[5])
    elif kind == "torchrun":
        torchrun_worker(cfg, out)
    else:
        raise SystemExit(f"elastic_peers_job: expected ours, torchft or torchrun, got {kind!r}")


if __name__ == "__main__":
    main()
