"""TorchState commits and rollbacks, and ZeroOptimizer.rebind, without failures.

A "recovery" here drops ranks by splitting the world (no process dies, so it runs on every MPI):
the survivors roll back to the last commit, rebuild the dropped ranks' ZeroOptimizer shards from
their buddies, re-partition and train on; the final weights must equal a single-process plain
torch run on the same global batches (tests/elastic_job_lib.py).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

import compressed
import elastic
import mpicomm
from elastic_job_lib import LR, allgather_rows, join_shards, local_loss, make_model, onebit_commit_view, \
    onebit_frozen_steps, reference
from mpitest import assert_all, check_all
from zero import ZeroOptimizer

WORLD = MPI.COMM_WORLD


pytestmark = pytest.mark.usefixtures("one_thread")


def test_bad_attribute_is_named():
    with pytest.raises(TypeError, match="attribute 'loader' of type object cannot be replicated"):
        elastic.TorchState(step=0, loader=object())
    state = elastic.TorchState(step=0)
    with pytest.raises(TypeError, match="attribute 'lock'"):
        state.lock = __import__("threading").Lock()


def test_checkpoint_arguments_are_checked():
    model = make_model()
    with pytest.raises(ValueError, match="checkpoint_dir and checkpoint_every go together"):
        elastic.TorchState(model=model, checkpoint_dir="/tmp/x")
    with pytest.raises(ValueError, match="checkpoint_every an int >= 1, got 0"):
        elastic.TorchState(model=model, checkpoint_dir="/tmp/x", checkpoint_every=0)
    with pytest.raises(ValueError, match="checkpoint_dir needs a model"):
        elastic.TorchState(checkpoint_dir="/tmp/x", checkpoint_every=2)
    with pytest.raises(AttributeError, match="checkpoint_every is fixed"):
        elastic.TorchState(model=model, checkpoint_dir="/tmp/x", checkpoint_every=2).checkpoint_every = 3


def test_failure_domain_is_checked_and_one_rank_replicates_to_itself():
    with pytest.raises(TypeError, match="failure_domain a non-empty str or None, got 3"):
        elastic.TorchState(failure_domain=3)
    with pytest.raises(TypeError, match="failure_domain a non-empty str or None, got ''"):
        elastic.TorchState(failure_domain="")
    comm = mpicomm.Communicator(MPI.COMM_SELF)
    model = make_model()
    opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=2, comm=comm, lr=LR)
    state = elastic.TorchState(model=model, optimizer=opt, failure_domain="rack-7", step=0)
    assert state.failure_domain == "rack-7" and state.replica_stride == 1
    with pytest.raises(AttributeError, match="failure_domain is fixed"):
        state.failure_domain = "rack-8"
    state.commit()
    assert state.replica_stride == 1


def _disk_run(ckdir: str, steps: int, stop: int | None = None, after_commit=None):
    """Train on one rank with a checkpoint every 3 commits; ``stop``: leave after that step
    without waiting for the save in flight (as a killed job would); ``after_commit(state)``:
    called after every commit."""
    comm = mpicomm.Communicator(MPI.COMM_SELF)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=1.0)
    gen, rnd = torch.Generator().manual_seed(3), __import__("random").Random(4)
    state = elastic.TorchState(model=model, optimizer=opt, comm=comm, checkpoint_dir=ckdir, checkpoint_every=3,
                               step=0, sched=sched, gen=gen, rnd=rnd, seen=torch.zeros(2), log=[])
    draws = []

    class Stop(Exception):
        pass

    @elastic.run
    def train(state):
        while state.step < steps:
            opt.zero_grad()
            local_loss(model, state.step, 0, 1).backward()
            opt.step()
            sched.step()
            draws.append((torch.rand(1, generator=state.gen).item(), state.rnd.random()))
            state.seen += 1
            state.log = state.log + [state.step]
            state.step += 1
            state.commit()
            if after_commit is not None:
                after_commit(state)
            if state.step == stop:
                raise Stop

    try:
        train(state)
    except Stop:
        pass
    return state, model, draws


def test_checkpoint_dir_resumes_from_the_newest_checkpoint(tmp_path):
    if WORLD.Get_size() > 1:
        pytest.skip("one rank writes into its own directory")
    ckdir = str(tmp_path / "ck")
    _, _, first = _disk_run(ckdir, 8, stop=7)
    ckpt = __import__("ckpt")
    ckpt.wait_pending()
    assert sorted(n for n in __import__("os").listdir(ckdir) if n.startswith("step")) == ["step3", "step6"]
    state, model, second = _disk_run(ckdir, 8)
    assert state.resumed["commits"] == 6 and state.resumed["path"].endswith("step6")
    assert state.step == 8 and state.commits == 8 and state.log == list(range(8))
    assert state.seen.tolist() == [8.0, 8.0]
    assert second == first[6:7] + [second[-1]]        # the generators continue from their saved state
    for p, ref in zip(model.parameters(), reference(8)):
        torch.testing.assert_close(p.detach(), ref, rtol=1e-5, atol=1e-6)


def _tree(path: str) -> dict[str, bytes]:
    os = __import__("os")
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), path)] = fh.read()
    return out


def test_leftovers_of_cut_short_saves_are_removed(tmp_path):
    if WORLD.Get_size() > 1:
        pytest.skip("one rank writes into its own directory")
    os = __import__("os")
    ckdir = str(tmp_path / "ck")
    _disk_run(ckdir, 8, stop=7)
    __import__("ckpt").wait_pending()
    published = _tree(ckdir)                      # step3, step6, latest
    stale = [".step9.tmp-0123456789ab", ".step6.tmp-fedcba987654"]   # cut short: a new step, a re-save
    for name in stale:
        os.makedirs(os.path.join(ckdir, name, "sub"))
        with open(os.path.join(ckdir, name, "INCOMPLETE"), "w") as f:
            f.write("{}\n")
    kept = [".step9.tmp-notes.txt", "step12.tmp-0123456789ab", "mine"]   # not a save's working dir
    for name in kept:
        os.makedirs(os.path.join(ckdir, name))
    state, _, _ = _disk_run(ckdir, 8)             # the resume removes them (no save is in flight)
    assert state.resumed["commits"] == 6
    names = sorted(os.listdir(ckdir))
    assert not set(stale) & set(names), names
    assert set(kept) <= set(names), names
    now = _tree(ckdir)
    assert {k: now[k] for k in published} == published          # every published file, byte for byte
    # a save that succeeds removes what one cut short left meanwhile (here: made after commit 7)
    seen = []

    def plant(state):
        if state.commits == 7:
            os.makedirs(os.path.join(ckdir, stale[0]))
        seen.append((state.commits, os.path.isdir(os.path.join(ckdir, stale[0]))))

    state, _, _ = _disk_run(ckdir, 9, after_commit=plant)   # resumes from step6, saves step9, waits
    assert seen == [(7, True), (8, True), (9, True)], seen   # still there while step9's save runs
    names = sorted(os.listdir(ckdir))
    assert "step9" in names and stale[0] not in names, names
    with open(os.path.join(ckdir, "latest")) as f:
        assert f.read().strip() == "step9"


def test_run_checks_its_arguments():
    with pytest.raises(ValueError, match="min_world_size >= 1"):
        elastic.run(min_world_size=0)
    with pytest.raises(TypeError, match="expected an elastic.TorchState"):
        elastic.run(lambda s: None)(3)
    with pytest.raises(ValueError, match="spare=True needs max_world_size"):
        elastic.run(spare=True)
    comm = mpicomm.Communicator(MPI.COMM_SELF)
    with pytest.raises(elastic.WorldTooSmallError, match="1 ranks, fewer than min_world_size=2"):
        elastic.run(min_world_size=2)(lambda s: None)(elastic.TorchState(comm=comm))


def test_an_error_that_is_no_failure_passes_through():
    comm = mpicomm.Communicator(MPI.COMM_SELF)

    @elastic.run
    def train(state):
        raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        train(elastic.TorchState(comm=comm, step=0))


def test_commit_and_rollback_replicated_state():
    comm = mpicomm.Communicator(MPI.COMM_SELF)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(4)
    state = elastic.TorchState(model=model, optimizer=opt, comm=comm, step=0, seen=[1], rng=gen)
    for step in range(2):
        opt.zero_grad()
        local_loss(model, step, 0, 1).backward()
        opt.step()
        state.step += 1
        state.commit()
    assert state.generation == 2
    kept = [p.detach().clone() for p in model.parameters()]
    next_rand = torch.rand(2, generator=gen)
    gen.manual_seed(4)
    torch.rand(5, generator=gen)
    opt.zero_grad()
    local_loss(model, 2, 0, 1).backward()
    opt.step()
    state.step, state.seen = 99, [1, 2]
    state._rollback(2, comm, [0], 1)
    assert state.step == 2 and state.seen == [1]
    for p, k in zip(model.parameters(), kept):
        assert torch.equal(p, k)
    assert torch.equal(torch.rand(2, generator=gen), next_rand)
    # the optimizer state was rolled back too: two more steps end as the reference's four
    for step in (2, 3):
        opt.zero_grad()
        local_loss(model, step, 0, 1).backward()
        opt.step()
    for p, r in zip(model.parameters(), reference(4)):
        torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("replicate", ["state", "gradient"])
@pytest.mark.parametrize("stage", [1, 2])
def test_rollback_sets_a_zero_optimizers_learning_rate_back(stage, replicate):
    """A failure seen in the commit, after the scheduler stepped: the rolled-back scheduler and
    the ZeroOptimizer's learning rate are the commit's again, so the step replayed sets the rate
    an uninterrupted run has (not one more decay)."""
    comm = mpicomm.Communicator(MPI.COMM_SELF)
    model = make_model()
    opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), stage=stage, comm=comm.dup(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = elastic.TorchState(model=model, optimizer=opt, step=0, sched=sched, replicate=replicate)

    def step() -> None:
        opt.zero_grad()
        local_loss(model, state.step, 0, 1).backward()
        opt.step()
        sched.step()
        state.step += 1

    step()
    state.commit()
    step()                                                  # the failure comes in the next commit
    assert opt.param_groups[0]["lr"] == LR / 4
    opt.param_groups[0]["weight_decay"] = 0.5               # changed by hand after the commit too
    state._rollback(state.generation, state.comm, [0], 1)
    assert state.step == 1 and state.sched.last_epoch == 1
    assert opt.param_groups[0]["lr"] == LR / 2 and opt.param_groups[0]["weight_decay"] == 0.01
    step()
    assert opt.param_groups[0]["lr"] == LR / 4 and state.sched.get_last_lr() == [LR / 4]


@pytest.mark.parametrize("stage", [1, 2])
def test_rebind_one_process(stage):
    """Rebinding to the same one-rank world from the joined state changes nothing."""
    comm = mpicomm.Communicator(MPI.COMM_SELF)
    model = make_model()
    opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=stage, comm=comm, lr=LR)
    for step in range(4):
        if step == 2:
            local = []
            for gi, g in enumerate(opt.groups):
                el, other = elastic.reshard.split_state(opt.shard_state(gi), g.master)
                local.append((g.master.clone(), {k: v.clone() for k, v in el.items()}, other))
            opt.rebind(mpicomm.Communicator(MPI.COMM_SELF), local)
        opt.zero_grad()
        local_loss(model, step, 0, 1).backward()
        opt.step()
    for p, r in zip(model.parameters(), reference(4)):
        torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-7)


def test_rebind_checks_sizes():
    comm = mpicomm.Communicator(MPI.COMM_SELF)
    opt = ZeroOptimizer(torch.optim.Adam, make_model().parameters(), stage=1, comm=comm, lr=LR)
    with pytest.raises(ValueError, match="expected 1 groups, got 0"):
        opt.rebind(comm, [])
    with pytest.raises(ValueError, match=r"'master': expected a flat tensor of 66 elements on cpu \(rank 0 of 1\), "
                                         r"got shape \(3,\)"):
        opt.rebind(comm, [(torch.zeros(3), {}, {})])
    with pytest.raises(ValueError, match=r"'exp_avg': expected a flat tensor of 66 elements"):
        opt.rebind(comm, [(torch.zeros(66), {"exp_avg": torch.zeros(6, 11)}, {})])
    with pytest.raises(TypeError, match="'master': expected float32, got torch.float64"):
        opt.rebind(comm, [(torch.zeros(66, dtype=torch.float64), {}, {})])


def _drop(world: mpicomm.Communicator, dropped: list[int]):
    """The communicator of the ranks not in ``dropped`` (None on a dropped rank)."""
    color = None if world.rank in dropped else 0
    return world.split(color, key=world.rank), [r for r in range(world.size) if r not in dropped]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("opt_kind,every", [("zero1", 1), ("zero2", 1), ("adam", 1), ("onebit", 1),
                                            ("zero2-mpi", 1), ("zero2-mixed", 1), ("zero1-gradient", 1),
                                            ("zero2-gradient", 1),
                                            ("zero2-gradient", 3)])
@pytest.mark.parametrize("drop", ["first", "last", "two"])
def test_rollback_over_fewer_ranks_matches_the_reference(opt_kind, drop, every, monkeypatch):
    """``onebit``: 1-bit Adam in its warm-up, which is Adam (without weight decay) exactly.
    ``-gradient``: ``replicate="gradient"``. ``-mpi``: replicas sent through MPI, as between
    hosts (on one host they go through shared memory); ``-mixed``: rank 0 seen on a host of its
    own, so some replicas go through MPI and others through shared memory. ``every``: commit after every step
    (replicated by gradient from the second commit on) or after step 3 only (a full commit);
    step 4 is done, not committed."""
    if opt_kind.endswith("-mpi"):
        monkeypatch.setenv(elastic.shm.ENV, "0")
        opt_kind = opt_kind[:-4]
    mixed = opt_kind.endswith("-mixed")
    if mixed:           # rank 0 alone on "hostA": some buddies here, some not
        monkeypatch.setattr(MPI, "Get_processor_name", lambda: "hostA" if WORLD.rank == 0 else "hostB")
        opt_kind = opt_kind[:-6]
    world = mpicomm.Communicator(WORLD)
    n = world.size
    dropped = {"first": [0], "last": [n - 1], "two": [0, 2] if n >= 4 else [0]}[drop]
    model = make_model()
    if opt_kind == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        comm = world
    elif opt_kind == "onebit":
        comm = world.dup()
        opt = ZeroOptimizer(compressed.OnebitAdam, model.parameters(), stage=2, comm=comm, lr=LR)
    else:
        comm = world.dup()
        opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=int(opt_kind[4]), comm=comm, lr=LR)

    def allreduce_grads(c):
        if opt_kind == "adam":
            for p in model.parameters():
                c.all_reduce(p.grad, op=mpicomm.ReduceOp.AVG)

    replicate = "gradient" if opt_kind.endswith("-gradient") else "state"
    state = elastic.TorchState(model=model, optimizer=opt, comm=comm, step=0, replicate=replicate)
    kinds = []
    while state.step < 4:
        opt.zero_grad()
        local_loss(model, state.step, state.rank, state.world_size).backward()
        allreduce_grads(comm)
        opt.step()
        state.step += 1
        if state.step < 4 and state.step % every == 0:
            state.commit()            # step 4 is done but not committed: the rollback undoes it
            kinds.append(state.commit_kind)
    want = {1: ["full", "gradient", "gradient"], 3: ["full"]}[every] if replicate == "gradient" \
        else ["state"] * (3 // every)
    assert kinds == want
    if mixed and n >= 3:
        through = WORLD.allgather(state._commits[-1].own_shm is not None)
        assert True in through and False in through, through
    new, survivors = _drop(world, dropped)
    if new is not None:
        def check():
            state._rollback(state.generation, new, survivors, n)
            assert state.step == 3 and state.world_size == n - len(dropped)
            if opt_kind != "adam":
                assert opt.comm is new and opt.world_size == new.size and opt.rank == new.rank
            while state.step < 5:
                opt.zero_grad()
                local_loss(model, state.step, state.rank, state.world_size).backward()
                allreduce_grads(new)
                opt.step()
                state.step += 1
                state.commit()
            for p, r in zip(model.parameters(), reference(5)):
                torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
        check_all(check, new.mpi_comm)
    WORLD.Barrier()


@pytest.mark.mpi(min_size=3)
def test_a_shard_and_its_buddy_lost_is_named():
    world = mpicomm.Communicator(WORLD)
    n = world.size
    model = make_model()
    opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=1, comm=world.dup(), lr=LR)
    state = elastic.TorchState(model=model, optimizer=opt, step=0)
    state.commit()
    new, survivors = _drop(world, [0, 1])
    ok = True
    if new is not None:
        try:
            state._rollback(1, new, survivors, n)
            ok = False
        except elastic.ShardsLostError as e:
            ok = e.lost == [0] and "old ranks [0] are lost" in str(e)
    assert_all(ok, "expected ShardsLostError naming old rank 0")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("drop", ["first", "last"])
def test_onebit_after_freeze_restarts_from_the_exact_mean_momentum(drop):
    """1-bit Adam after freeze_step (compressed, each rank its own local momentum): the survivors
    roll back to commit 3 with every master, the frozen variance and the step exactly as
    committed, and the mean of the old ranks' local momenta (a float64 mean of the momenta
    gathered at the commit) as ``exp_avg``; error feedback restarts at zero. Then one more
    step on the survivors (weights checked against a float64 computation where one rank is left,
    which compresses nothing)."""
    world = mpicomm.Communicator(WORLD)
    n = world.size
    model = make_model()
    comm = world.dup()
    betas, freeze = (0.9, 0.999), 2
    opt = ZeroOptimizer(compressed.OnebitAdam, model.parameters(), stage=2, comm=comm, lr=LR, freeze_step=freeze)
    state = elastic.TorchState(model=model, optimizer=opt, step=0)
    while state.step < 4:
        opt.zero_grad()
        local_loss(model, state.step, state.rank, state.world_size).backward()
        opt.step()
        state.step += 1
        if state.step < 4:
            state.commit()
        if state.step == 3:        # what commit 3 holds, gathered independently of elastic
            view = onebit_commit_view(opt)
            want_m, want_master, want_v = view["exp_avg"], view["master"], view["exp_avg_sq"]
            weights = [p.detach().clone() for p in model.parameters()]
    assert opt.optimizer.frozen and opt.optimizer.global_step == 4
    new, survivors = _drop(world, [0] if drop == "first" else [n - 1])
    if new is not None:
        def check():
            state._rollback(3, new, survivors, n)
            inner = opt.optimizer
            assert state.step == 3 and inner.global_step == 3 and opt.world_size == n - 1
            assert inner._local == {}, "the local momenta must restart from the mean"
            gi = opt.groups[0]
            st = inner.state[gi.master]
            got = lambda t: join_shards(gi.layout, list(allgather_rows(new, t)))   # noqa: E731
            torch.testing.assert_close(got(gi.master), want_master, rtol=0, atol=0)
            torch.testing.assert_close(got(st["exp_avg_sq"]), want_v, rtol=0, atol=0)
            torch.testing.assert_close(got(st["exp_avg"]).double(), want_m, rtol=1e-6, atol=1e-9)
            for p, w in zip(model.parameters(), weights):
                torch.testing.assert_close(p.detach(), w, rtol=0, atol=0)
            opt.zero_grad()
            local_loss(model, 3, state.rank, state.world_size).backward()
            opt.step()
            (loc,) = inner._local.values()
            if new.size == 1:      # the float64 step: momentum from the mean, variance frozen
                want = onebit_frozen_steps(want_master, want_m, want_v, 3, 4, freeze, betas)
                torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double(),
                                           want, rtol=1e-5, atol=1e-7)
            else:                  # compressed: every survivor's worker error started at zero
                assert loc["err"].abs().sum() > 0
        check_all(check, new.mpi_comm)
    WORLD.Barrier()
