"""Fault-injection job for tests/test_elastic_faults.py: train under elastic.run, one rank dies.

    mpirun --with-ft ulfm -n N python tests/elastic_job.py OPT WHERE RANK STEP STEPS OUT [EVERY] [grow=N] [join=wait]
        [newcomer=dies] [pending=R] [second=R] [again=R:S] [freeze=F] [spare=ready|early] [unseen=R:S]
        [injoin=R] [inspawn=R] [inshrink=R] [idle=N]

OPT: ddp | zero1 | zero2 (ZeroOptimizer stage) | zero1g | zero2g (the same, replicate="gradient") | onebit (ZeroOptimizer stage 2 of 1-bit Adam, in its
warm-up: Adam exactly); WHERE: none | between (after the commit of step
STEP) | backward (inside a DDP bucket allreduce / ZeroOptimizer gradient reduction) | zstep
(inside ZeroOptimizer.step, in the wrapped optimizer's update: after a ZeroOptimizer of a plain
optimizer sent its gradient to the buddy, before the update) | commit (inside commit(), between
sending two shard pieces to the buddy: a full-state commit; the replicas go through MPI, as
between hosts, MPICOMM_ELASTIC_SHM=0) | copy (inside commit(), half way through copying the shard
into the shared memory its buddy maps: the copy is cut short) | exchange (between the sends of the
gradient exchange at the first update after a commit) | agree / agreed (inside commit(), just
before / after the commit's agreement) | disagree (RANK says False to that agreement once and
lives on) | gather (right after the step's last all-gather of the
weights returned on the victim: on the survivors it may have completed or not); RANK: the world rank that os._exit(9)s at step STEP.
EVERY: commit every EVERY steps (default 1; a commit after more than one update sends the full
state). grow=N: elastic.run(max_world_size=N), replacements spawned after the loss join the
job (Open MPI, ULFM); second=R: world rank R dies too, in the recovery, right after its
ZeroOptimizer was rebound to the survivors; again=R:S: world rank R dies too, later, after the
commit of step S (after the job grew back: a second recovery with a replacement training);
join=wait: the replacements join at the recovery's commit (else at a later one, the job training
on meanwhile); newcomer=dies: the replacement SIGKILLs itself as it starts; pending=R: world rank
R dies while the replacements start; spare=ready: elastic.run(spare=True), and the ranks wait
until the spare said it is ready before the victim dies (spare=early: they do not); unseen=R:S:
at the commit of step S every rank waits until the replacement said it is ready to it, and world
rank R dies right after that commit's agreement to let it join (unseen by the others until the join); injoin=R:
world rank R dies inside the join, as it starts to make torch's default group anew over the grown
world (its second reinit_process_group: the first is the recovery's); inspawn=R: world rank R dies
as the replacements are spawned (the others wait inside MPI_Comm_spawn); inshrink=R: world rank R
dies in the first recovery, as it makes the survivors' Communicator after MPI's shrink returned; idle=N: after the
victim's death the others commit N times more before their next step, exchanging nothing but
the commits' agreements (as a job waiting for replacements at the end does); freeze=F: 1-bit Adam's freeze_step (compressed after it),
and rank 0 writes what each commit past it must hold, gathered apart from elastic
(OUT.commit<N>.npz); death=sigkill: the victim is SIGKILLed instead of exiting with status 9
(Open MPI's launcher ends a 2-rank job when one rank exits with an error status). Every rank writes its final weights
(OUT.rank<R>.npz, a replacement OUT.new<rank>.npz); the new rank 0 writes the final weights (OUT.npz) and what happened (OUT.json: with the
kind of each commit) for the test to compare with the single-process reference.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compressed  # noqa: E402
import elastic  # noqa: E402
import mpicomm  # noqa: E402
from elastic_job_lib import LR, local_loss, make_model, onebit_commit_view  # noqa: E402
from mpicomm import distributed as mdist  # noqa: E402
from zero import ZeroOptimizer  # noqa: E402


def main() -> None:
    opt_kind, where, victim, kill_step, steps, out = sys.argv[1:7]
    victim, kill_step, steps = int(victim), int(kill_step), int(steps)
    every = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    opts = dict(a.split("=", 1) for a in sys.argv[8:])
    grow_to = int(opts["grow"]) if "grow" in opts else None      # elastic.run(max_world_size=...)
    # (the ranks named below are original ranks; -2: none, as a replacement's is -1)
    second = int(opts.get("second", -2))        # a rank that dies in the recovery, after its rebind
    again, again_step = (int(x) for x in opts.get("again", "-2:-2").split(":"))   # a later death
    pending = int(opts.get("pending", -2))      # dies while the replacements start
    unseen, unseen_step = (int(x) for x in opts.get("unseen", "-2:-2").split(":"))   # dies as they join
    injoin = int(opts.get("injoin", -2))        # dies inside the join
    inside = [False]                     # inside state.commit()
    idled = [False]                      # the idle=N commits were made
    kinds: list[str] = []
    torch.set_num_threads(1)
    world = mpicomm.init()
    joined = elastic.grow.joining()      # a replacement spawned by the growing job
    me = world.rank if not joined else -1    # the original rank: the victim is named by it

    def die(at: str) -> None:
        if where == at and me == victim:
            if opts.get("death") == "sigkill":      # as an OOM kill or a crash ends a process
                sys.stdout.flush(), sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(9)

    if where == "commit":
        os.environ[elastic.shm.ENV] = "0"
    if where == "copy":
        copy = elastic.commit.copy_polling

        def copy_then_die(dst, src, works):
            if inside[0] and state.step == kill_step + 1 and me == victim:
                dst[0].view(-1)[: dst[0].numel() // 2].copy_(src[0].reshape(-1)[: dst[0].numel() // 2])
                die("copy")
            copy(dst, src, works)
        elastic.commit.copy_polling = copy_then_die

    mdist.init_process_group()
    model = make_model()
    if opt_kind == "ddp":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        state = elastic.TorchState(model=model, optimizer=opt, comm=world, step=0)
    else:
        inner = compressed.OnebitAdam if opt_kind == "onebit" else torch.optim.Adam
        extra = {"freeze_step": int(opts["freeze"])} if "freeze" in opts else {}    # 1-bit Adam compresses after it
        opt = ZeroOptimizer(inner, model.parameters(), stage=2 if opt_kind == "onebit" else int(opt_kind[4]),
                            comm=world.dup(), lr=LR, bucket_bytes=64, **extra)
        state = elastic.TorchState(model=model, optimizer=opt, step=0,
                                   replicate="gradient" if opt_kind.endswith("g") else "state")
        if where == "zstep":
            inner_step = opt.optimizer.step

            def step_then_die(*a, **k):
                die("zstep" if state.step == kill_step else "")
                return inner_step(*a, **k)
            opt.optimizer.step = step_then_die
        if where in ("commit", "exchange"):
            sends = [0]

            def isend_then_die(*a, **k):
                if state.step == kill_step + 1 and inside[0] == (where == "commit"):
                    sends[0] += 1
                    die(where if sends[0] == 2 else "")
                return type(opt.comm).isend(opt.comm, *a, **k)
            opt.comm.isend = isend_then_die
        if where in ("agree", "agreed", "disagree"):
            comm, said = opt.comm, [False]

            def agree_then_die(flag, **k):
                now = inside[0] and state.step == kill_step + 1
                die("agree" if now else "")
                if where == "disagree" and now and me == victim and not said[0]:
                    said[0], flag = True, False     # as where Open MPI reported a failure that is none
                out = type(comm).agree(comm, flag, **k)
                die("agreed" if now else "")
                return out
            comm.agree = agree_then_die
    if where == "gather" and opt_kind != "ddp":
        # right after the step's last all-gather returned here: on the others it may or may not have
        gather = opt._grad_comm.all_gather_into_tensor

        def gather_then_die(*a, **k):
            out = gather(*a, **k)
            die("gather" if state.step == kill_step else "")
            return out
        opt._grad_comm.all_gather_into_tensor = gather_then_die
    if second >= 0 and me == second and opt_kind != "ddp":
        rebind = opt.rebind

        def rebind_then_die(*a, **k):     # in the recovery of the first failure, after the rebind
            rebind(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)   # (a second os._exit(9) makes the launcher end the job)
        opt.rebind = rebind_then_die
    if where == "backward":
        # the first weight's gradient comes last in backward: the other buckets are in flight
        list(model.parameters())[0].register_post_accumulate_grad_hook(
            lambda p: die("backward" if state.step == kill_step else ""))

    if me == unseen:
        agree_poll = elastic.epoch.poll

        def poll_then_die(st, ready, keep):     # the others agreed to the join with it and go on to it
            out = agree_poll(st, ready, keep)
            if st.step == unseen_step and out[0]:
                sys.stdout.flush(), sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        elastic.epoch.poll = poll_then_die

    if me == injoin:
        reinit, calls = mdist.reinit_process_group, [0]

        def reinit_or_die(*a, **k):         # the group's rank 0 hosts its store: the others wait on it
            calls[0] += 1
            if calls[0] == 2:
                sys.stdout.flush(), sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return reinit(*a, **k)
        mdist.reinit_process_group = reinit_or_die

    if me == int(opts.get("inshrink", -2)):
        node_rank = mpicomm.communicator._node_rank

        def node_rank_or_die(mpi_comm, *a, **k):    # making the survivors' Communicator, after MPI's shrink
            if mpi_comm.Get_size() < world.size:
                sys.stdout.flush(), sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return node_rank(mpi_comm, *a, **k)
        mpicomm.communicator._node_rank = node_rank_or_die

    if me == int(opts.get("inspawn", -2)):
        def spawn_or_die(*a, **k):          # the others enter the spawn
            sys.stdout.flush(), sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        elastic.grow._spawn = spawn_or_die

    def wait_for_the_spare() -> None:    # (a peek at elastic's internals: the spare's message, not received)
        p = state._growing
        while p is not None and not p.merged.Iprobe(source=p.old_world, tag=elastic.grow.READY_TAG):
            time.sleep(0.05)

    @elastic.run(max_world_size=grow_to, wait_for_replacements=opts.get("join") == "wait", spare="spare" in opts)
    def train(state: elastic.TorchState) -> None:
        net = model
        if opt_kind == "ddp":
            net = DDP(model, bucket_cap_mb=0.0001)     # a bucket per parameter
        while state.step < steps:
            opt.zero_grad()
            local_loss(net, state.step, state.rank, state.world_size).backward()
            opt.step()
            state.step += 1
            if state.step == unseen_step and me >= 0:
                wait_for_the_spare()        # (any replacement: every rank hears it before this commit)
            if state.step % every == 0 or state.step == steps:
                inside[0] = True
                state.commit()
                inside[0] = False
                kinds.append(state.commit_kind)
                if "freeze" in opts and opt.optimizer._local:   # compressing: what the commit must hold, gathered apart
                    view = onebit_commit_view(opt)
                    if state.rank == 0:
                        np.savez(f"{out}.commit{state.commits}.npz", **{k: v.numpy() for k, v in view.items()})
            if opts.get("spare") == "ready" and state.step == kill_step + 1 and me >= 0:
                wait_for_the_spare()
            die("between" if state.step == kill_step + 1 else "")
            if state.step == kill_step + 1 and not idled[0]:
                idled[0] = True
                for _ in range(int(opts.get("idle", 0))):
                    state.commit()
            if me == again and state.step == again_step + 1 or me == pending and state.growing:
                sys.stdout.flush(), sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)   # (a second os._exit(9) makes the launcher end the job)
        while state.growing:        # replacements start while the job trains: commits until they joined
            time.sleep(0.05)
            state.commit()

    if joined and opts.get("newcomer") == "dies":   # a replacement that dies while it starts
        os.kill(os.getpid(), signal.SIGKILL)
    train(state)
    weights = {f"p{i}": p.detach().numpy() for i, p in enumerate(model.parameters())}
    np.savez(f"{out}.{'rank' + str(me) if me >= 0 else 'new' + str(state.rank)}.npz", **weights)   # every rank's
    if state.rank == 0:
        np.savez(out + ".npz", **weights)
        with open(out + ".json", "w") as f:
            json.dump({"world_size": state.world_size, "dist_world_size": dist.get_world_size(),
                       "recoveries": state.recoveries, "growths": state.growths, "commit_kinds": kinds,
                       "zero_world": getattr(opt, "world_size", None)}, f)
    dist.destroy_process_group()
    state.comm.barrier()
    # Workaround: after a rank failure, leaving through MPI_Finalize sometimes hung here (Open MPI
    # 5.0.11, ULFM; the results were written): the survivors end without it once all are done.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
