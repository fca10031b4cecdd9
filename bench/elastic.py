"""elastic: what a lost rank costs (detection, recovery) and what commits cost, beside the same
training that lost nothing.

    mpirun --with-ft ulfm -n 4 python -m bench elastic --params 20M --kill-rank 1 --kill-step 3
    python -m bench elastic --chaos 20      # one process: 20 ULFM jobs, ranks killed at random (elastic_chaos)
    python -m bench elastic --soak 120 --kill-every 30      # one process: with and without kills (elastic_soak)
    python -m bench elastic --peers --params 20M            # one process: torchft, torchrun beside (elastic_peers)
    python -m bench elastic --growth 3      # one process: a growth's parts beside torch's own start-up (elastic_growth)

Part 1, at the full world, no failure: per mode (DDP + Adam; ZeroOptimizer stage 2 + Adam with
``replicate="state"``, "zero" (on one host the buddy maps the rank's copy in shared memory:
elastic.shm), the same with every replica sent through MPI as between hosts
(``MPICOMM_ELASTIC_SHM=0``), "zero-mpi", and with ``replicate="gradient"``, "zero-grad"),
rounds of four steps: two not committed, then two each followed by ``state.commit()``. The
second step of each pair is timed: a step two updates after a commit (no commit work at all), and
a step one update after a commit with its commit (zero-grad: its step copies the shard and sends
the gradient to the buddy, its commit replays the ward's update: elastic.gradrep); the cost
of committing every step against the step not committed; the time of the first commit of a pair
(three updates after the previous commit: the full shards are sent); and the memory the commits
a rank holds take (copies, the ward's replica and gradient) beside one optimizer shard. Part 2: the
ZeroOptimizer training of ``--failure-mode`` again, committing every step, and rank ``--kill-rank``
``os._exit(9)``s at step ``--kill-step``: detection (its death to the survivors' error, wall
clocks of one host), recovery (its death to the survivors' first committed step), of which the
time in ``elastic.recover`` and the step done again with its commit, and the run's time beside
part 1's. Part 2 needs ``mpirun --with-ft ulfm`` (Open MPI with ULFM); elsewhere it is left
out, saying why.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import elastic
import mpicomm
from zero import ZeroOptimizer


MODES = ("ddp", "zero", "zero-mpi", "zero-grad")


def _count(text: str) -> int:
    units = {"K": 10**3, "M": 10**6, "G": 10**9}
    t = text.strip().upper()
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def make_model(params: int, width: int) -> torch.nn.Module:
    """An MLP of ``width``-wide Linear layers with about ``params`` parameters."""
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods[:-1])


def _setup(args, comm, mode: str):
    model = make_model(args.params, args.width)
    if mode == "ddp":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        state = elastic.TorchState(model=model, optimizer=opt, comm=comm, step=0)
    else:       # "zero"/"zero-mpi" keep two generations of the state, "zero-grad" the update's inputs
        opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=2, comm=comm.dup(), lr=1e-4)
        state = elastic.TorchState(model=model, optimizer=opt, step=0,
                                   replicate="gradient" if mode == "zero-grad" else "state")
    return model, opt, state


def _step(args, model, opt, state, mode: str) -> None:
    g = torch.Generator().manual_seed(state.step)
    x = torch.randn(args.batch, args.width, generator=g)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    if mode == "ddp":
        for p in model.parameters():
            state.comm.all_reduce(p.grad, op=mpicomm.ReduceOp.AVG)
    opt.step()


def _shard_bytes(opt) -> int:
    if isinstance(opt, ZeroOptimizer):
        return sum(g.master.numel() * 4 * 3 for g in opt.groups)    # fp32 master + Adam's two moments
    return sum(p.numel() * 4 * 3 for g in opt.param_groups for p in g["params"])


class _Replicas:
    """``MPICOMM_ELASTIC_SHM=0`` while a "-mpi" mode runs (its replicas go through MPI)."""

    def __init__(self, mode: str) -> None:
        self.mode, self.was = mode, None

    def __enter__(self) -> None:
        if self.mode.endswith("-mpi"):
            self.was = os.environ.get(elastic.shm.ENV)
            os.environ[elastic.shm.ENV] = "0"

    def __exit__(self, *exc) -> None:
        if self.mode.endswith("-mpi"):
            if self.was is None:
                os.environ.pop(elastic.shm.ENV, None)
            else:
                os.environ[elastic.shm.ENV] = self.was


def part_commit(args, comm, mode: str) -> dict:
    """Step time and commit time per step, no failure."""
    with _Replicas(mode):
        return _part_commit(args, comm, mode)


def _part_commit(args, comm, mode: str) -> dict:
    model, opt, state = _setup(args, comm, mode)
    _step(args, model, opt, state, mode)        # warm-up (optimizer state exists from here)
    state.commit()
    bare, steps, commits, fulls, repl, kinds = [], [], [], [], [], set()
    cpu_bare, cpu_cost = [], []         # this thread's CPU seconds (user + system)
    for i in range(4 * args.steps):     # rounds: two steps not committed, two committed
        comm.barrier()
        r0 = getattr(state, "replicate_seconds", 0.0)
        c0, t0 = time.thread_time(), time.perf_counter()
        _step(args, model, opt, state, mode)
        t1 = time.perf_counter()
        state.step += 1
        if i % 4 == 1:
            bare.append(t1 - t0)
            cpu_bare.append(time.thread_time() - c0)
        elif i % 4 >= 2:
            state.commit()
            t2 = time.perf_counter()
            if i % 4 == 3:
                steps.append(t1 - t0)
                commits.append(t2 - t1)
                repl.append(getattr(state, "replicate_seconds", 0.0) - r0)
                cpu_cost.append(time.thread_time() - c0)
                kinds.add(getattr(state, "commit_kind", "state"))
            else:
                fulls.append(t2 - t1)
    held = state.replica_bytes()
    bare_s, step_s, commit_s, full_s, repl_s = (statistics.median(x) for x in (bare, steps, commits, fulls, repl))
    cpu = torch.tensor([statistics.median(cpu_bare), statistics.median(cpu_cost)], dtype=torch.float64)
    comm.all_reduce(cpu)                # the ranks' medians, summed
    row = {"mode": mode, "ranks": comm.size, "bare_s": bare_s, "step_s": step_s, "commit_s": commit_s,
           "cost_s": step_s + commit_s - bare_s, "full_s": full_s, "repl_s": repl_s, "kinds": sorted(kinds),
           "cpu_cost": float(cpu[1] / cpu[0] - 1), "held_bytes": held,
           "shard_bytes": _shard_bytes(opt), "total_s": sum(steps) + sum(commits)}
    if isinstance(opt, ZeroOptimizer):
        opt.close()
    return row


def part_failure(args, comm, stamp: str) -> dict:
    """The ZeroOptimizer training, committing every step; one rank dies at --kill-step."""
    with _Replicas(args.failure_mode):
        return _part_failure(args, comm, stamp)


def _part_failure(args, comm, stamp: str) -> dict:
    model, opt, state = _setup(args, comm, args.failure_mode)
    me = comm.rank
    marks: dict[str, float] = {}

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        while state.step < args.steps:
            if me == args.kill_rank and state.step == args.kill_step:
                with open(stamp, "w") as f:
                    f.write(repr(time.time()))
                os._exit(9)
            _step(args, model, opt, state, args.failure_mode)
            state.step += 1
            state.commit()
            if state.recoveries and "first_commit" not in marks:
                marks["first_commit"] = time.time()

    t0 = time.perf_counter()
    train(state)
    total = time.perf_counter() - t0
    with open(stamp) as f:
        death = float(f.read())
    state.comm.barrier()        # every survivor has read it before rank 0 removes its folder
    r = state.recoveries[0]
    return {"ranks": f"{comm.size}->{state.world_size}", "detect_s": r["started_at"] - death,
            "recover_s": marks["first_commit"] - death, "in_recovery_s": r["recover_s"],
            "again_s": marks["first_commit"] - (r["started_at"] + r["recover_s"]),
            "total_s": total, "state": state}


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench elastic", description=__doc__.split("\n")[0])
    p.add_argument("--params", type=_count, default=_count("20M"), help="model parameters (e.g. 100M)")
    p.add_argument("--width", type=int, default=1024, help="width of the MLP's Linear layers")
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=6,
                   help="timed rounds of part 1 (4 steps each); steps of part 2")
    p.add_argument("--kill-rank", type=int, default=1, help="rank that dies in part 2")
    p.add_argument("--kill-step", type=int, default=3, help="step at which it dies")
    p.add_argument("--failure-mode", choices=MODES[1:], default="zero",
                   help="part 2's replication: of the state (two generations; -mpi: through MPI on "
                        "one host too) or of the gradient")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    c = p.add_argument_group("chaos (run as one process; each trial is its own `mpirun --with-ft ulfm -n 4` job: "
                             "bench/elastic_chaos.py)")
    c.add_argument("--chaos", type=int, metavar="N", help="N trials of ranks killed at random moments")
    c.add_argument("--chaos-seed", type=int, metavar="S", help="run the trial of seed S alone")
    c.add_argument("--chaos-modes", metavar="M,M", help="modes to draw from (default: all of "
                   "ddp,zero1,zero2,zero1-mpi,zero2-mpi,fsdp2)")
    c.add_argument("--chaos-steps", type=int, default=8, help="training steps per trial")
    c.add_argument("--chaos-grow", default="none", metavar="G,G", help="how the job grows back, drawn per trial "
                   "from none (it only shrinks), grow (elastic.run(max_world_size=4)), spare (and spare=True)")
    c.add_argument("--seed", type=int, help="base seed of --chaos (trial i: seed*1000+i); default from the clock")
    c.add_argument("--trial-timeout", type=float, default=150.0, help="seconds before a trial counts as a hang")
    c.add_argument("--findings", metavar="FILE", help="append each failed trial (outcome, rerun command, "
                   "what every rank printed) to FILE")
    c.add_argument("--keep", metavar="DIR", help="keep every trial's files under DIR (default: failed ones only)")
    k = p.add_argument_group("soak (run as one process: two `mpirun --with-ft ulfm -n 4` jobs, bench/elastic_soak.py)")
    k.add_argument("--soak", type=float, metavar="SECONDS", help="train this long with a rank killed every "
                   "--kill-every seconds, beside the same training without failures")
    k.add_argument("--kill-every", type=float, default=30.0, metavar="S", help="seconds between kills")
    k.add_argument("--soak-mode", choices=("ddp", "zero2", "zero2-mpi"), default="zero2")
    k.add_argument("--soak-width", type=int, default=256, help="width of the soak MLP")
    k.add_argument("--soak-layers", type=int, default=4, help="Linear layers of the soak MLP")
    k.add_argument("--soak-batch", type=int, default=64, help="global batch of the soak")
    k.add_argument("--soak-no-grow", action="store_true", help="no max_world_size: the job only shrinks")
    k.add_argument("--soak-join-wait", action="store_true",
                   help="wait_for_replacements=True: the survivors wait for the replacements at the recovery")
    k.add_argument("--soak-spare", action="store_true", help="a third run: the kills with elastic.run(spare=True) "
                   "(a replacement started ahead; with --growth: a third job per round)")
    k.add_argument("--growth", type=int, metavar="N", help="N rounds of one growth, split into elastic's part and "
                   "the replacement's start-up, beside a bare torch process's start-up (bench/elastic_growth.py; "
                   "--soak-width, --soak-layers and --soak-batch apply)")
    q = p.add_argument_group("peers (run as one process: bench/elastic_peers.py; --params, --width, --batch and "
                             "--kill-step apply; worker 1 is killed)")
    q.add_argument("--peers", action="store_true", help="torchft 0.2 and torchrun + DCP beside elastic")
    q.add_argument("--peers-steps", type=int, default=20, help="steps of each peer run (enough for a replacement to join)")
    q.add_argument("--peers-ours", choices=("ddp", "zero2"), default="zero2", help="elastic's training in --peers")
    q.add_argument("--peers-systems", default="elastic,torchft,torchrun",
                   help="comma-separated: which of elastic, torchft, torchrun to run")
    q.add_argument("--peers-torchft-join-ms", type=int, default=10000,
                   help="torchft lighthouse's join_timeout_ms (its default is 60000)")
    q.add_argument("--peers-kill-at", choices=("start", "backward"), default="start",
                   help="where in its step worker 1 dies: before it (torchft: before the step's quorum) or in "
                        "backward (the step's gradient reductions under way)")
    args = p.parse_args(argv)
    if args.peers:
        from . import elastic_peers
        return elastic_peers.main(args)
    if args.growth is not None:
        from . import elastic_growth
        return elastic_growth.main(args)
    if args.soak is not None:
        from . import elastic_soak
        return elastic_soak.main(args)
    if args.chaos is not None or args.chaos_seed is not None:
        from . import elastic_chaos
        return elastic_chaos.main(args)
    torch.set_num_threads(args.threads)
    comm = mpicomm.init()
    if comm.rank == 0:
        n = sum(q.numel() for q in make_model(args.params, args.width).parameters())
        print(f"# bench elastic: {comm.size} ranks, {n / 1e6:.1f}M parameters, Adam, commit every step")
        print("# rounds of 4 steps (medians): step ms: two updates after a commit, not committed; step+ ms: "
              "one update after a commit, committed; commit ms: its state.commit(); cost/step: (step+ + commit "
              "- step) / step; repl ms: of step+, replicating (own copy, gradient exchange); cpu cost: the same "
              "ratio in the ranks' thread CPU time; full ms: a commit three updates after the previous one; "
              "kind: of the timed commits")
        print(f"{'mode':<10}{'ranks':>6}{'step ms':>10}{'step+ ms':>10}{'repl ms':>9}{'commit ms':>11}"
              f"{'cost/step':>11}{'cpu cost':>10}{'full ms':>9}{'kind':>10}{'commits MiB':>13}{'shard MiB':>11}")
    for mode in MODES:
        row = part_commit(args, comm, mode)
        if comm.rank == 0:
            print(f"{mode:<10}{row['ranks']:>6}{row['bare_s'] * 1e3:>10.1f}{row['step_s'] * 1e3:>10.1f}"
                  f"{row['repl_s'] * 1e3:>9.1f}{row['commit_s'] * 1e3:>11.1f}{row['cost_s'] / row['bare_s']:>10.1%} "
                  f"{row['cpu_cost']:>9.1%} {row['full_s'] * 1e3:>8.1f} {'/'.join(row['kinds']):>9} "
                  f"{_mb(row['held_bytes']):>12}{_mb(row['shard_bytes']):>11}")
        if mode == args.failure_mode:
            base = row
    if not getattr(comm, "fault_tolerant", False):
        if comm.rank == 0:
            print("# part 2 (a rank killed) left out: needs an MPI with ULFM, "
                  "`mpirun --with-ft ulfm` with Open MPI")
        return 0
    if not 0 <= args.kill_rank < comm.size or comm.size < 2:
        print(f"bench elastic: expected 0 <= --kill-rank < {comm.size} and 2+ ranks", file=sys.stderr)
        return 2
    where = comm.mpi_comm.bcast(tempfile.mkdtemp(prefix="bench-elastic-") if comm.rank == 0 else None, root=0)
    stamp = os.path.join(where, "death")     # the victim's wall time of death (one host)
    res = part_failure(args, comm, stamp)
    state = res.pop("state")
    if state.rank == 0:
        shutil.rmtree(where, ignore_errors=True)
        print(f"\n# {args.failure_mode}, rank {args.kill_rank} killed at step {args.kill_step} of {args.steps}")
        print(f"{'ranks':<8}{'detect s':>10}{'recover s':>11}{'in recovery s':>15}{'step again s':>14}"
              f"{'run s':>8}{'lost nothing s':>16}")
        print(f"{res['ranks']:<8}{res['detect_s']:>10.3f}{res['recover_s']:>11.3f}{res['in_recovery_s']:>15.3f}"
              f"{res['again_s']:>14.3f}{res['total_s']:>8.2f}{base['total_s']:>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
