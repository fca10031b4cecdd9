"""What a commit holds of a ZeroOptimizer's shards, checked against the live shards sent point
to point with mpi4py: replicas exact after commits by gradient, replicas on one host through
shared memory, and shared-memory slots that say which commit they hold."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

import elastic
import mpicomm
from elastic_job_lib import LR, local_loss, make_model
from mpitest import assert_all, check_all
from zero import ZeroOptimizer

WORLD = MPI.COMM_WORLD


pytestmark = pytest.mark.usefixtures("one_thread")


def _replicas_exact(state: elastic.TorchState, opt: ZeroOptimizer) -> bool:
    """Whether this rank's newest commit holds its ward's shard exactly as the ward has it live
    (sent here point to point with mpi4py, not by elastic), and its own as it is live."""
    comm = opt.comm.mpi_comm
    n, r, s = comm.Get_size(), comm.Get_rank(), state.replica_stride
    c = state._commits[-1]
    live = [t for gi, g in enumerate(opt.groups)
            for t in [g.master] + [v for k, v in sorted(opt.shard_state(gi).items()) if k != "step"]]
    ok = len(c.ward) == len(live) == len(c.own)
    for mine, held, own in zip(live, c.ward, c.own):
        got = np.empty(mine.numel(), dtype=np.float32)
        comm.Sendrecv(np.ascontiguousarray(mine.numpy()), dest=(r + s) % n, recvbuf=got, source=(r - s) % n)
        ok = ok and np.array_equal(got, held.numpy()) and torch.equal(own, mine)
    return ok


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", [1, 2])
def test_commits_by_gradient_keep_every_replica_exact(stage):
    """AdamW with a scheduler changing the learning rate every step, clipping and a skipped
    step: after every commit the ward's replica equals the ward's live shard bit for bit, and the
    commit is by gradient exactly when one update separates it from the previous one."""
    world = mpicomm.Communicator(WORLD)
    model = make_model()
    opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), stage=stage, comm=world.dup(), lr=LR,
                        weight_decay=0.1, skip_nonfinite=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    state = elastic.TorchState(model=model, optimizer=opt, step=0, sched=sched, replicate="gradient")
    kinds, exact = [], []

    def step(bad: bool = False) -> None:
        opt.zero_grad()
        loss = local_loss(model, state.step, state.rank, state.world_size)
        if bad and state.rank == 0:
            loss = loss * float("inf")
        loss.backward()
        opt.clip_grad_norm_(0.05)
        opt.step()
        sched.step()
        state.step += 1

    def commit() -> None:
        state.commit()
        kinds.append(state.commit_kind)
        exact.append(_replicas_exact(state, opt))

    commit()                        # the first: full
    step(), commit()                # one update: by gradient
    step(), commit()
    commit()                        # no update since: full
    step(), step(), commit()        # two updates: full
    step(bad=True), commit()        # the step was skipped on every rank: full
    assert opt.skipped_steps == 1
    step(), commit()                # by gradient again
    assert kinds == ["full", "gradient", "gradient", "full", "full", "full", "gradient"], kinds
    assert_all(all(exact), f"replicas not exact after commits {exact}")
    # held: the own copy and the ward's replica (master, exp_avg, exp_avg_sq) and the ward's
    # gradient, 4 bytes each per shard element; the model's weights are gathered from the masters
    numel = sum(g.master.numel() for g in opt.groups)
    assert state.replica_bytes() == (3 + 3 + 1) * 4 * numel, (state.replica_bytes(), numel)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shared", [True, False])
def test_replicas_on_one_host_go_through_shared_memory(shared, monkeypatch):
    """On one host the buddy maps the rank's own committed copy (no copy of its own, nothing
    sent) and its live shard, which moves into shared memory: one commit, one extra shard; with
    MPICOMM_ELASTIC_SHM=0 it receives a copy, two commits held. Either way the ward's copy held
    here is the ward's shard at the commit, as the ward sends it now."""
    if not shared:
        monkeypatch.setenv(elastic.shm.ENV, "0")
    world = mpicomm.Communicator(WORLD)
    comm = world.dup()
    model = make_model()
    opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=2, comm=comm, lr=LR)
    state = elastic.TorchState(model=model, optimizer=opt, comm=comm, step=0)
    me, n = comm.rank, comm.size
    for step in range(3):
        opt.zero_grad()
        local_loss(model, step, me, n).backward()
        opt.step()
        state.step += 1
        state.commit()
    c = state._commits[-1]
    live = [t.detach().clone() for t in state._live_pieces()[0]]
    buddy, ward = (me + 1) % n, (me - 1) % n
    theirs = [torch.empty_like(t) for t in live]
    works = [comm.isend(t, buddy, tag=77 + i) for i, t in enumerate(live)]
    works += [comm.irecv(t, ward, tag=77 + i) for i, t in enumerate(theirs)]
    for w in works:
        w.wait()

    def check():
        assert (c.ward_shm is not None) == shared and (c.own_shm is not None) == shared
        for got, want in zip(c.ward, theirs):
            assert torch.equal(got, want), "the ward's copy differs from its shard at the commit"
        for got, want in zip(c.own, live):
            assert torch.equal(got, want)
        own = sum(t.numel() * t.element_size() for t in live)
        held = sum(x.nbytes() for x in state._commits) - sum(
            elastic.values.nbytes(x.model) + elastic.values.nbytes(x.attrs) for x in state._commits)
        assert held == (1 if shared else 4) * own, (held, own)
        assert c.ward_pieces() is c.ward      # whole: the ward's copy itself
        assert len(state._commits) == (1 if shared else 2)   # after commits on one set of segments
        if shared:      # the live shard is in the area the buddy maps, and updates go there
            area = state._shared[1].own.live_pieces()
            assert [t.data_ptr() for t in state._live_pieces()[0]] == [a.data_ptr() for a in area]
            for got, want in zip(c.ward_live, theirs):
                assert torch.equal(got, want), "the ward's live shard differs from what it sent"
    check_all(check, WORLD)
    if shared:      # an optimizer that makes a state tensor anew: moved back after the update
        st = opt.optimizer.state[opt.groups[0].master]
        st["exp_avg"] = st["exp_avg"].clone()
        opt.zero_grad()
        local_loss(model, 3, me, n).backward()
        opt.step()

        def moved_back():
            area = state._shared[1].own.live_pieces()
            assert [t.data_ptr() for t in state._live_pieces()[0]] == [a.data_ptr() for a in area]
            assert torch.equal(area[1], st["exp_avg"].reshape(-1))
        check_all(moved_back, WORLD)
    WORLD.Barrier()


def test_shared_segment_slots_say_which_commit_they_hold():
    """Slots alternate by the commit's parity; a slot being written, or written by a later
    commit, no longer holds the commit."""
    pieces = [torch.zeros(5), torch.zeros(3, dtype=torch.bfloat16)]
    made = elastic.shm._create(elastic.shm._specs(pieces))
    if made is None:
        pytest.skip("no room in /dev/shm")
    os_path = elastic.shm.os.path.join(elastic.shm.DIR, made[0])
    elastic.shm.os.unlink(os_path)
    seg = elastic.shm.Segment(made[1], elastic.shm._specs(pieces))
    assert [t.shape for t in seg.pieces(1)] == [(5,), (3,)] and seg.pieces(1)[1].dtype == torch.bfloat16
    assert seg.pieces(1)[0].data_ptr() != seg.pieces(2)[0].data_ptr()
    assert seg.pieces(1)[0].data_ptr() == seg.pieces(3)[0].data_ptr()
    seg.begin(1)
    seg.pieces(1)[0].fill_(1.5)
    assert not seg.holds(1) and seg.writing(1) and not seg.writing(3)
    seg.finish(1)
    assert seg.holds(1) and not seg.holds(3) and not seg.holds(2) and not seg.writing(1)
    seg.begin(3)                 # the owner overwrites the slot with commit 3
    assert not seg.holds(1) and not seg.holds(3)
    assert seg.writing(3) and not seg.writing(1), "a torn slot says which commit it was being written with"
    seg.finish(3)
    assert seg.holds(3) and not seg.holds(1)
