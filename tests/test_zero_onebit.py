"""1-bit Adam inside ZeroOptimizer (stages 1 and 2): warm-up is ZeRO Adam, then compressed momenta.

References: ZeroOptimizer(torch.optim.Adam) for the warm-up (itself checked against plain torch
elsewhere), compressed.OnebitAdam without ZeRO for convergence, the calls in mpicomm's per-call
DEBUG log for "no full-size fp32 allreduce" and an mpi4py allgather for agreement between ranks.
"""
from __future__ import annotations

import logging
import re

import pytest
import torch
from mpi4py import MPI

import ckpt
from zero import ZeroOptimizer
import compressed
import mpicomm
from mpitest import assert_all, assert_close_all

WORLD = MPI.COMM_WORLD
MODES = [pytest.param("mpi", marks=pytest.mark.mpi, id="mpi"), pytest.param("one", id="one")]


def make_model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 4)).to(dtype)


def batch(rank: int, step: int, dtype=torch.float32):
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=g)
    return x.to(dtype), x @ w + 0.01 * torch.randn(32, 4, generator=g)


def train(model, opt, steps: int, rank: int, dtype=torch.float32) -> float:
    for s in range(steps):
        opt.zero_grad()
        x, y = batch(rank, s, dtype)
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
    x, y = batch(999, 10 ** 6)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_warmup_equals_zero_adam(mode, stage, wd):
    comm = mpicomm.init()
    a, b = make_model(), make_model()
    oa = ZeroOptimizer(compressed.OnebitAdam, a.parameters(), stage=stage, comm=comm, lr=1e-2,
                            weight_decay=wd, freeze_step=100)
    ob = ZeroOptimizer(torch.optim.Adam, b.parameters(), stage=stage, comm=comm, lr=1e-2, weight_decay=wd)
    train(a, oa, 5, comm.rank)
    train(b, ob, 5, comm.rank)
    for p, q in zip(a.parameters(), b.parameters()):
        assert_close_all(p, q, atol=1e-6, what="warm-up parameters vs ZeRO Adam")


pytestmark = pytest.mark.usefixtures("one_thread")


class Calls(logging.Handler):
    """Records (op, dtype, bytes) of every collective this rank issues, on any communicator, from
    mpicomm's per-call DEBUG log, until close(). ``bytes`` counts all the call's buffers."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.log = []
        self._logger = logging.getLogger("mpicomm")
        self._level = self._logger.level
        self._logger.addHandler(self)
        self._logger.setLevel(logging.DEBUG)

    def close(self) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)
        super().close()

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("rank %d: %s %s %s in"):
            _, op, dtype, size = record.args[:4]
            self.log.append((op, dtype, int(re.search(r"(\d+) B\)?$", size).group(1))))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", [1, 2])
def test_frozen_phase_compressed_and_ranks_agree(stage):
    comm = mpicomm.init()
    model = make_model()
    opt = ZeroOptimizer(compressed.OnebitAdam, model.parameters(), stage=stage, comm=comm, lr=1e-2,
                             freeze_step=3)
    train(model, opt, 4, comm.rank)          # the first frozen step gathers the momentum once
    calls = Calls()
    try:
        train(model, opt, 3, comm.rank)
    finally:
        calls.close()
    numel = sum(p.numel() for p in model.parameters())
    log = calls.log
    fp32_big = [c for c in log if c[1] == "float32" and c[2] >= 4 * (numel // comm.size) and
                c[0] != "all_gather_into_tensor"]
    assert_all(not fp32_big, f"fp32 gradient/momentum traffic after freeze_step: {fp32_big}")
    a2a = [c for c in log if c[0] == "all_to_all_single"]
    assert_all(len(a2a) == 3 and all(c[1] == "uint8" for c in a2a), f"sign exchange calls {a2a}")
    with pytest.raises(RuntimeError, match="freeze_step"):
        opt.clip_grad_norm_(1.0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    everyone = WORLD.allgather(flat.tobytes())
    assert_all(all(x == everyone[0] for x in everyone), "parameters differ between ranks")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_converges_like_onebit_adam(mode, stage, dtype):
    comm = mpicomm.init()
    ref_model = make_model()
    ref = train(ref_model, compressed.OnebitAdam(ref_model.parameters(), lr=1e-2, freeze_step=20, comm=comm),
                100, comm.rank)
    model = make_model(dtype)
    start = train(model, ZeroOptimizer(compressed.OnebitAdam, model.parameters(), stage=stage, comm=comm,
                                            lr=0.0, freeze_step=20), 1, comm.rank, dtype)
    model = make_model(dtype)
    opt = ZeroOptimizer(compressed.OnebitAdam, model.parameters(), stage=stage, comm=comm, lr=1e-2,
                             freeze_step=20)
    got = train(model, opt, 100, comm.rank, dtype)
    assert_all(opt.optimizer.frozen and got < start / 3, f"loss {got} from {start}: did not train")
    assert_all(got <= 2 * ref, f"ZeRO 1-bit Adam loss {got} vs OnebitAdam without ZeRO {ref}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", [1, 2])
def test_resume_after_freeze_is_exact_at_the_same_size(shared_tmp_path, stage):
    comm = mpicomm.init()
    model = make_model()
    opt = ZeroOptimizer(compressed.OnebitAdam, model.parameters(), stage=stage, comm=comm, lr=1e-2,
                             freeze_step=5)
    train(model, opt, 30, comm.rank)
    path = str(shared_tmp_path / "ob")
    ckpt.save(path, model=model, optimizer=opt, step=30, comm=comm)
    model2 = make_model()
    opt2 = ZeroOptimizer(compressed.OnebitAdam, model2.parameters(), stage=stage, comm=comm, lr=1e-2,
                              freeze_step=5)
    ckpt.load(path, model=model2, optimizer=opt2, comm=comm)
    assert_all(opt2.optimizer.global_step == 30 and opt2.optimizer.frozen, "step count restored")
    train(model, opt, 20, comm.rank)
    train(model2, opt2, 20, comm.rank)
    for p, q in zip(model2.parameters(), model.parameters()):
        assert_close_all(p, q, what="resumed vs uninterrupted parameters (bit for bit)")


@pytest.mark.mpi(min_size=2)
def test_resume_after_freeze_at_another_size_restarts_local_momenta(world, shared_tmp_path):
    comm = mpicomm.init()
    path = str(shared_tmp_path / "ob")
    model = make_model()
    opt = ZeroOptimizer(compressed.OnebitAdam, model.parameters(), stage=1, comm=comm, lr=1e-2,
                             freeze_step=5)
    train(model, opt, 30, comm.rank)
    ckpt.save(path, model=model, optimizer=opt, step=30, comm=comm)
    a = train(model, opt, 20, comm.rank)
    c = world.Split(0 if world.rank == 0 else MPI.UNDEFINED, world.rank)
    one = None if c == MPI.COMM_NULL else mpicomm.Communicator(c)
    if one is not None:                       # rank 0 alone resumes the 2+-rank run
        model2 = make_model()
        opt2 = ZeroOptimizer(compressed.OnebitAdam, model2.parameters(), stage=1, comm=one, lr=1e-2,
                                  freeze_step=5)
        ckpt.load(path, model=model2, optimizer=opt2, comm=one)
        b = train(model2, opt2, 20, 0)
        assert b < 2 * a, f"resumed at 1 rank: loss {b} vs {a} uninterrupted"
        c.Free()
    world.Barrier()
