"""save(async_save=True): what is saved is the state when save returned, latest moves at the
commit, one save in flight per communicator, failures raised on every rank at the next
wait/save/load, and a job killed mid-write leaves the previous checkpoint loadable."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import mpicomm
from mpicomm import clean_env
import torch
from mpi4py import MPI
from mpitest import check_all, mpiexec_cmd

import ckpt
from zero import ZeroOptimizer
from ckpt import api as ckpt_api
from ckpt import async_save

HERE = os.path.dirname(os.path.abspath(__file__))


def make(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5)).to(dtype)


def stepped(comm, kind, stage=1, dtype=torch.float32):
    net = make(0, dtype)
    if kind == "zero":
        opt = ZeroOptimizer(torch.optim.AdamW, net.parameters(), stage=stage, comm=comm, lr=0.01)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for s in range(2):
        g = torch.Generator().manual_seed(s)
        opt.zero_grad()
        net(torch.randn(4, 33, generator=g).to(dtype)).float().square().mean().backward()
        opt.step()
    return net, opt


def opt_state(opt):
    if isinstance(opt, ZeroOptimizer):
        out = []
        for gi, g in enumerate(opt.groups):
            out.append(g.master.clone())
            out += [v.clone() for _, v in sorted(opt.shard_state(gi).items()) if isinstance(v, torch.Tensor)]
        return out
    return [v.clone() for st in opt.state.values() for _, v in sorted(st.items())]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("snapshot", ["now", "background"])
@pytest.mark.parametrize("kind,stage,dtype", [("plain", 1, torch.float32), ("zero", 1, torch.float32),
                                              ("zero", 2, torch.bfloat16)])
def test_changes_after_save_returns_are_not_saved(comm, world, shared_tmp_path, kind, stage, dtype, snapshot):
    net, opt = stepped(comm, kind, stage, dtype)
    model_ref = {k: v.clone() for k, v in net.state_dict().items()}
    opt_ref = opt_state(opt)
    handle = ckpt.save(shared_tmp_path / "s1", model=net, optimizer=opt, step=2, comm=comm, async_save=True,
                       snapshot=snapshot)
    assert isinstance(handle, ckpt.SaveHandle)
    # with snapshot='background' the step below waits for the copy (a step pre-hook)
    # the training loop goes on at once: another step, then everything overwritten in place
    g = torch.Generator().manual_seed(9)
    opt.zero_grad()
    net(torch.randn(4, 33, generator=g).to(dtype)).float().square().mean().backward()
    opt.step()
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(123.0)
        for t in opt_state(opt):
            t.fill_(-1.0)
        if isinstance(opt, ZeroOptimizer):
            for g in opt.groups:
                g.master.fill_(5.0)
    m = handle.wait()
    assert handle.is_completed() and handle.is_success() and m.step == 2

    net2, opt2 = stepped(comm, kind, stage, dtype)  # a fresh copy, then loaded over
    with torch.no_grad():
        for p in net2.parameters():
            p.zero_()
    ckpt.load(shared_tmp_path, model=net2, optimizer=opt2, comm=comm)

    def check():
        for k, v in model_ref.items():
            assert torch.equal(net2.state_dict()[k], v), k
        got = opt_state(opt2)
        assert len(got) == len(opt_ref) and all(torch.equal(a, b) for a, b in zip(got, opt_ref))
    check_all(check)


@pytest.mark.mpi(min_size=1)
def test_latest_moves_at_commit_and_a_second_save_waits(comm, world, shared_tmp_path, monkeypatch):
    net, opt = stepped(comm, "zero")
    ckpt.save(shared_tmp_path / "s1", model=net, optimizer=opt, step=1, comm=comm)
    gate = threading.Event()
    real = ckpt_api.commit_save

    def held(*a, **kw):
        assert gate.wait(60), "the test never opened the gate"
        return real(*a, **kw)

    monkeypatch.setattr(ckpt_api, "commit_save", held)
    h2 = ckpt.save(shared_tmp_path / "s2", model=net, optimizer=opt, step=2, comm=comm, async_save=True)
    latest = shared_tmp_path / "latest"
    future = h2.get_future()  # asked for while the save is pending

    def before():
        assert isinstance(h2, mpicomm.work.BaseWork)
        assert not h2.is_completed() and not future.done()
        with pytest.raises(mpicomm.WaitTimeoutError, match="the asynchronous save did not complete"):
            h2.wait(timeout=0.05)  # it goes on
        assert latest.read_text().strip() == "s1", "latest moved before the commit"
        assert not (shared_tmp_path / "s2").exists()
    check_all(before)
    world.Barrier()
    threading.Timer(0.5, gate.set).start()
    # a second save waits for the first to commit
    h3 = ckpt.save(shared_tmp_path / "s3", model=net, optimizer=opt, step=3, comm=comm, async_save=True)

    def after():
        assert h2.is_completed() and h2.wait().step == 2
        assert future.wait() is h2.result() and h2.result().step == 2
        assert (shared_tmp_path / "s2" / "manifest.json").exists()
    check_all(after)
    assert h3.wait().step == 3
    ckpt.wait_pending()
    check_all(lambda: (_ for _ in ()).throw(AssertionError(latest.read_text()))
              if latest.read_text().strip() != "s3" else None)


def _held_background_snapshot(monkeypatch):
    """A gate the background snapshot waits at before copying."""
    gate = threading.Event()
    real = async_save.BackgroundSnapshot.take

    def held(self):
        assert gate.wait(60), "the test never opened the gate"
        return real(self)

    monkeypatch.setattr(async_save.BackgroundSnapshot, "take", held)
    return gate


def _bn_net(comm, kind):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    if kind == "zero":
        return net, ZeroOptimizer(torch.optim.SGD, net.parameters(), stage=1, comm=comm, lr=0.1, momentum=0.9)
    return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["plain", "zero"])
def test_background_snapshot_waits_for_nothing_but_the_step(comm, world, shared_tmp_path, monkeypatch, kind):
    """snapshot='background': save returns before the parameters are copied; forward and
    backward run meanwhile (module buffers were copied at return: BatchNorm's running stats
    change in forward); step() waits for the copy; what is saved is the state at save()."""
    net, opt = _bn_net(comm, kind)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))  # replicated: the same on every rank
    for _ in range(2):
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    ref = {k: v.clone() for k, v in net.state_dict().items()}
    opt_ref = opt_state(opt)
    gate = _held_background_snapshot(monkeypatch)
    h = ckpt.save(shared_tmp_path / "b", model=net, optimizer=opt, comm=comm, async_save=True,
                  snapshot="background")
    opt.zero_grad()
    net(x).square().mean().backward()  # changes the running stats, not the parameters
    assert not h.snapshot_done()
    threading.Timer(0.3, gate.set).start()
    opt.step()  # waits for the copy
    assert h.snapshot_done()
    h.wait()
    net2, opt2 = _bn_net(comm, kind)
    ckpt.load(shared_tmp_path / "b", model=net2, optimizer=opt2, comm=comm)

    def check():
        for k, v in ref.items():
            assert torch.equal(net2.state_dict()[k], v), k
        got = opt_state(opt2)
        assert len(got) == len(opt_ref) > 0 and all(torch.equal(a, b) for a, b in zip(got, opt_ref))
    check_all(check)
    assert not opt._optimizer_step_pre_hooks, "the step pre-hook outlived the save"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["plain", "zero"])
def test_change_before_the_background_snapshot_fails_the_save(comm, world, shared_tmp_path, monkeypatch, kind):
    net, opt = stepped(comm, kind)
    ckpt.save(shared_tmp_path / "s1", model=net, optimizer=opt, step=1, comm=comm)
    gate = _held_background_snapshot(monkeypatch)
    h = ckpt.save(shared_tmp_path / "s2", model=net, optimizer=opt, step=2, comm=comm, async_save=True,
                  snapshot="background")
    if comm.rank == comm.size - 1:  # one rank changes what is saved outside the optimizer's step
        with torch.no_grad():
            (opt.groups[0].master if kind == "zero" else net[2].bias).add_(1.0)
    gate.set()
    changed = "master shard of group 0" if kind == "zero" else "parameter '2.bias'"

    def raised():
        with pytest.raises(ckpt.CheckpointError, match=rf"{changed}.*changed after save\(\) returned"
                           if comm.rank == comm.size - 1 else "changed after save"):
            h.wait()
    check_all(raised)
    assert not (shared_tmp_path / "s2").exists()
    assert (shared_tmp_path / "latest").read_text().strip() == "s1"
    assert not opt._optimizer_step_pre_hooks
    monkeypatch.undo()
    h = ckpt.save(shared_tmp_path / "s3", model=net, optimizer=opt, step=3, comm=comm, async_save=True,
                  snapshot="background")
    assert h.wait().step == 3


def test_background_snapshot_needs_async_and_an_optimizer(comm, world, tmp_path):
    if world.Get_size() > 1:
        pytest.skip("single-process test")
    net, opt = stepped(comm, "plain")
    with pytest.raises(ValueError, match="snapshot='background' needs async_save=True.*async_save=False"):
        ckpt.save(tmp_path / "a", model=net, optimizer=opt, comm=comm, snapshot="background")
    with pytest.raises(ValueError, match="optimizer of type NoneType"):
        ckpt.save(tmp_path / "a", model=net, comm=comm, async_save=True, snapshot="background")
    with pytest.raises(ValueError, match="expected snapshot='now' or 'background', got 'later'"):
        ckpt.save(tmp_path / "a", model=net, optimizer=opt, comm=comm, async_save=True, snapshot="later")
    with torch.inference_mode():
        frozen = torch.nn.Linear(3, 2)  # inference tensors: no version counter
    with pytest.raises(ckpt.CheckpointError, match="parameter 'weight' is an inference tensor.*snapshot='now'"):
        ckpt.save(tmp_path / "a", model=frozen, optimizer=torch.optim.SGD(frozen.parameters(), lr=0.1),
                  comm=comm, async_save=True, snapshot="background")
    assert not (tmp_path / "a").exists()


def _fail_on_last_rank(monkeypatch, comm):
    real = ckpt_api.write_items

    def failing(*a, **kw):
        out = real(*a, **kw)  # every rank joins every collective call, then the last one fails (its sync)
        if comm.rank == comm.size - 1:
            raise OSError("injected: no space left on device")
        return out

    monkeypatch.setattr(ckpt_api, "write_items", failing)
    return real


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("where", ["wait", "save", "load", "wait_pending"])
def test_background_failure_is_raised_on_every_rank_once(comm, world, shared_tmp_path, monkeypatch, where):
    net, opt = stepped(comm, "zero")
    ckpt.save(shared_tmp_path / "s1", model=net, optimizer=opt, step=1, comm=comm)
    real = _fail_on_last_rank(monkeypatch, comm)
    h = ckpt.save(shared_tmp_path / "s2", model=net, optimizer=opt, step=2, comm=comm, async_save=True)
    future = h.get_future()

    def next_call():
        if where == "wait":
            h.wait()
        elif where == "save":
            ckpt.save(shared_tmp_path / "s3", model=net, optimizer=opt, step=3, comm=comm)
        elif where == "load":
            ckpt.load(shared_tmp_path, model=net, optimizer=opt, comm=comm)
        else:
            ckpt.wait_pending()

    def raised():
        with pytest.raises(OSError, match="injected: no space left"):
            next_call()
    check_all(raised)

    def settled():  # the handle and its future tell the same failure
        assert h.is_completed() and not h.is_success() and isinstance(h.exception(), OSError)
        with pytest.raises(OSError, match="injected: no space left"):
            future.wait()
    check_all(settled)
    monkeypatch.setattr(ckpt_api, "write_items", real)
    # raised once: the next calls work, and the failed save left the previous checkpoint
    res = ckpt.load(shared_tmp_path, model=net, optimizer=opt, comm=comm)
    check_all(lambda: None if res.step == 1 else (_ for _ in ()).throw(AssertionError(res.step)))
    ckpt.save(shared_tmp_path / "s4", model=net, optimizer=opt, step=4, comm=comm, async_save=True).wait()
    assert ckpt.load(shared_tmp_path, model=net, optimizer=opt, comm=comm).step == 4


def test_snapshot_memory_is_reused(comm, world, tmp_path):
    if world.Get_size() > 1:
        pytest.skip("single-process test")
    net, opt = stepped(comm, "plain")
    ckpt.save(tmp_path / "a", model=net, optimizer=opt, comm=comm, async_save=True).wait()
    arena = async_save.slot_for(comm).pool.arena
    ptr = arena.data_ptr()
    assert arena.numel() >= sum(p.numel() * 3 * 4 for p in net.parameters())
    for name in ("b", "c"):
        ckpt.save(tmp_path / name, model=net, optimizer=opt, comm=comm, async_save=True).wait()
        assert async_save.slot_for(comm).pool.arena.data_ptr() == ptr


def test_refused_without_thread_multiple(comm, world, tmp_path, monkeypatch):
    if world.Get_size() > 1:
        pytest.skip("single-process test")
    monkeypatch.setattr(async_save.MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    net = make()
    with pytest.raises(ckpt.AsyncSaveError, match="MPI_THREAD_MULTIPLE.*MPI_THREAD_SERIALIZED"):
        ckpt.save(tmp_path / "a", model=net, comm=comm, async_save=True)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("ranks", [1, 2])
def test_job_killed_during_an_async_save_leaves_the_previous_checkpoint(tmp_path, ranks):
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("launches its own mpiexec job")
    env = clean_env()
    env["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [*mpiexec_cmd(ranks), sys.executable, "-m", "mpi4py", os.path.join(HERE, "ckpt_async_job.py"),
           str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0, "the job was to be killed"
    assert (tmp_path / "killed").exists(), out.stdout + out.stderr[-3000:]
    assert (tmp_path / "latest").read_text().strip() == "s1"
    assert not (tmp_path / "s2").exists()
    work = [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    assert work, "the save was killed after its working directory was made"
    with pytest.raises(ckpt.IncompleteCheckpointError):
        ckpt.load(tmp_path / work[0], model=make(), comm=MPI.COMM_SELF)
    net = make(1)
    res = ckpt.load(tmp_path, model=net, comm=MPI.COMM_SELF)
    ref = make(0)
    assert res.step == 1
    for (k, a), b in zip(net.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), k
