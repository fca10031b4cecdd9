"""ZeroOptimizer in a training loop: global clipping, accumulation, overlap, non-finite skips, misuse.

The reference is DDP-style training written out by hand: every rank keeps a full model, its
gradients are averaged with a plain mpi4py Allreduce, clipped with torch.nn.utils.clip_grad_norm_
and stepped with the same torch optimizer. Runs at 1 rank (plain pytest) and under mpiexec.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from mpi4py import MPI

import ckpt
from zero import ZeroOptimizer
import mpicomm
from mpitest import assert_all, assert_close_all, check_all

WORLD = MPI.COMM_WORLD
MODES = [pytest.param("mpi", marks=pytest.mark.mpi, id="mpi"), pytest.param("one", id="one")]
OPTS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        "adamw": (torch.optim.AdamW, {"lr": 0.02, "weight_decay": 0.01})}


pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(seed: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 35 + 7 + 28 + 4 + 12 + 3 elements: odd sizes, so both stages pad at 2 and 4 ranks
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 3))


def loss_of(model, step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10000 * step + 100 * micro + rank)
    x, y = torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def averaged_grads(model) -> None:
    """Replace each grad by its mean over the world (plain Allreduce: the DDP reference)."""
    for p in model.parameters():
        buf = p.grad.detach().numpy().astype(np.float64)
        out = np.empty_like(buf)
        WORLD.Allreduce(buf, out, op=MPI.SUM)
        p.grad.copy_(torch.from_numpy(out / WORLD.size))


def run_pair(stage, opt_name, micro, no_sync, max_norm, norm_type, steps=3, bucket_bytes=48):
    """Train ZeroOptimizer and the DDP-style reference side by side; return both models."""
    comm = mpicomm.init()
    cls, kw = OPTS[opt_name]
    model, ref = make_model(), make_model()
    opt = ZeroOptimizer(cls, model.parameters(), stage=stage, comm=comm, bucket_bytes=bucket_bytes, **kw)
    ropt = cls(ref.parameters(), **kw)
    norms, rnorms = [], []
    for s in range(steps):
        opt.zero_grad()
        ropt.zero_grad()
        for m in range(micro):
            last = m == micro - 1
            if no_sync and not last:
                with opt.no_sync():
                    loss_of(model, s, m, comm.rank).backward()
            else:
                loss_of(model, s, m, comm.rank).backward()
            loss_of(ref, s, m, comm.rank).backward()
        averaged_grads(ref)
        if max_norm is not None:
            norms.append(float(opt.clip_grad_norm_(max_norm, norm_type)))
            rnorms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)))
        opt.step()
        ropt.step()
    return model, ref, norms, rnorms, opt


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt_name", list(OPTS))
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_clip_matches_ddp_style(mode, stage, opt_name, norm_type):
    model, ref, norms, rnorms, _ = run_pair(stage, opt_name, micro=1, no_sync=False, max_norm=0.05,
                                            norm_type=norm_type)
    assert_close_all(np.array(norms), np.array(rnorms), rtol=1e-5, what="returned norms")
    assert_all(all(n > 0.05 for n in rnorms), f"reference norms {rnorms} should need clipping")
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close_all(p, q, atol=1e-5, what="parameters after clipped steps")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "plain"])
def test_clip_with_accumulation(mode, stage, no_sync):
    # stage 2 without no_sync: each backward sends its gradients, later ones add to the shards
    model, ref, norms, rnorms, opt = run_pair(stage, "adamw", micro=3, no_sync=no_sync, max_norm=0.05,
                                              norm_type=2.0)
    assert_close_all(np.array(norms), np.array(rnorms), rtol=1e-5, what="returned norms")
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close_all(p, q, atol=1e-5, what="parameters after accumulated, clipped steps")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", [1, 2])
def test_no_clip_when_norm_is_small_and_overlap_off(mode, stage):
    comm = mpicomm.init()
    model, ref = make_model(), make_model()
    opt = ZeroOptimizer(torch.optim.SGD, model.parameters(), stage=stage, comm=comm, overlap=False, lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(2):
        opt.zero_grad()
        ropt.zero_grad()
        loss_of(model, s, 0, comm.rank).backward()
        loss_of(ref, s, 0, comm.rank).backward()
        averaged_grads(ref)
        n = opt.clip_grad_norm_(1e6)
        rn = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e6)
        assert_close_all(n, rn, rtol=1e-5, what="norm")
        opt.step()
        ropt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close_all(p, q, atol=1e-6, what="parameters")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stage", [1, 2])
def test_overlap_launches_buckets_during_backward(stage, monkeypatch):
    comm = mpicomm.init()
    launched = []  # async_op of every gradient reduce-scatter, in call order
    real = mpicomm.Communicator.reduce_scatter_tensor

    def counted(self, *args, **kwargs):
        launched.append(kwargs.get("async_op", False))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(mpicomm.Communicator, "reduce_scatter_tensor", counted)
    model = make_model()
    opt = ZeroOptimizer(torch.optim.SGD, model.parameters(), stage=stage, comm=comm, bucket_bytes=48, lr=0.1)
    loss_of(model, 0, 0, comm.rank).backward()
    during = len(launched)
    opt.step()
    assert_all(during == len(launched) > 2 and all(launched),
               f"{during} of {len(launched)} gradient reduce-scatters launched (async) by backward's hooks")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", [1, 2])
def test_skip_nonfinite_skips_everywhere(mode, stage, caplog):
    comm = mpicomm.init()
    model, ref = make_model(), make_model()
    opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), stage=stage, comm=comm, skip_nonfinite=True,
                             lr=0.02)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.02)
    bad_rank = comm.size - 1
    for s in range(4):
        opt.zero_grad()
        ropt.zero_grad()
        bad = s == 1 and comm.rank == bad_rank       # an overflowing loss on one rank only
        (loss_of(model, s, 0, comm.rank) * (math.inf if bad else 1.0)).backward()
        loss_of(ref, s, 0, comm.rank).backward()
        before = [p.detach().clone() for p in model.parameters()]
        n = opt.clip_grad_norm_(0.5)
        opt.step()
        if s == 1:
            assert_all(math.isnan(float(n)), f"norm {float(n)} with a non-finite gradient")
            assert_all(opt.last_step_skipped and opt.skipped_steps == 1, "step 1 skipped and counted")
            for p, b in zip(model.parameters(), before):
                assert_close_all(p, b, what="parameters unchanged by a skipped step")
            continue
        averaged_grads(ref)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ropt.step()
    assert_all(opt.skipped_steps == 1 and not opt.last_step_skipped, f"skipped {opt.skipped_steps}")
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close_all(p, q, atol=1e-5, what="parameters after a skipped step")


@pytest.mark.parametrize("mode", MODES)
def test_error_if_nonfinite(mode):
    comm = mpicomm.init()
    model = make_model()
    opt = ZeroOptimizer(torch.optim.SGD, model.parameters(), comm=comm, lr=0.1)
    (loss_of(model, 0, 0, comm.rank) * (math.inf if comm.rank == 0 else 1.0)).backward()
    check_all(lambda: pytest.raises(RuntimeError, opt.clip_grad_norm_, 1.0, error_if_nonfinite=True))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("overlap", [True, False])
def test_torch_clip_on_zero_params_is_refused(mode, stage, overlap):
    comm = mpicomm.init()
    model = make_model()
    opt = ZeroOptimizer(torch.optim.SGD, model.parameters(), stage=stage, comm=comm, overlap=overlap, lr=0.1)
    loss_of(model, 0, 0, comm.rank).backward()
    if stage == 2 and overlap:   # the gradients left during backward: nothing here for torch to clip
        assert_all(all(p.grad is None for p in model.parameters()), "stage 2 released the gradients")
        return
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    before = [p.detach().clone() for p in model.parameters()]

    def refused():
        with pytest.raises(RuntimeError, match="clip_grad_norm_"):
            opt.step()
    check_all(refused)
    for p, b in zip(model.parameters(), before):
        assert_close_all(p, b, what="parameters unchanged by a refused step")
    # the optimizer stays usable
    opt.zero_grad()
    loss_of(model, 1, 0, comm.rank).backward()
    opt.step()


@pytest.mark.mpi(min_size=2)
def test_one_rank_scaling_its_grads_is_refused_everywhere():
    comm = mpicomm.init()
    model = make_model()
    opt = ZeroOptimizer(torch.optim.SGD, model.parameters(), comm=comm, lr=0.1)
    loss_of(model, 0, 0, comm.rank).backward()
    if comm.rank == 1:
        list(model.parameters())[-1].grad.mul_(0.5)

    def refused():
        with pytest.raises(RuntimeError, match=r"on ranks \[1\]"):
            opt.clip_grad_norm_(1.0)
    check_all(refused)


def test_inner_optimizers_that_cannot_shard_are_refused():
    comm = mpicomm.init()
    p = [torch.nn.Parameter(torch.randn(4, 3))]
    for cls in (torch.optim.LBFGS, torch.optim.Adafactor, torch.optim.Muon, torch.optim.SparseAdam):
        with pytest.raises(TypeError, match="cannot shard"):
            ZeroOptimizer(cls, p, comm=comm)

    class Talker(torch.optim.SGD):
        def __init__(self, params, lr=0.1, comm=None):
            super().__init__(params, lr=lr)
    with pytest.raises(TypeError, match="communicates by itself"):
        ZeroOptimizer(Talker, p, comm=comm)

    class Custom(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})
    with pytest.warns(UserWarning, match="not a known elementwise"):
        ZeroOptimizer(Custom, p, comm=comm)

    class Declared(Custom):
        elementwise = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZeroOptimizer(Declared, p, comm=comm)
    with pytest.raises(ValueError, match="bucket_bytes"):
        ZeroOptimizer(torch.optim.SGD, p, comm=comm, bucket_bytes=0, lr=0.1)


@pytest.mark.parametrize("mode", MODES)
def test_stage2_same_result_and_frees_grads(mode):
    comm = mpicomm.init()
    model, ref = make_model(), make_model()
    opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), stage=2, comm=comm, bucket_bytes=48, lr=0.02)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.02)
    for s in range(3):
        opt.zero_grad()
        ropt.zero_grad()
        for m in range(2):
            if m == 0:
                with opt.no_sync():
                    loss_of(model, s, m, comm.rank).backward()
            else:
                loss_of(model, s, m, comm.rank).backward()
            loss_of(ref, s, m, comm.rank).backward()
        assert_all(all(p.grad is None for p in model.parameters()), "grads released after backward")
        averaged_grads(ref)
        n = opt.clip_grad_norm_(0.05)
        rn = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert_close_all(n, rn, rtol=1e-5, what="norm")
        opt.step()
        ropt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close_all(p, q, atol=1e-5, what="stage 2 parameters")


class Gated(torch.nn.Module):
    """Two branches; ``use_b`` picks whether the second one takes part (its parameters then get
    no gradient in that backward)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.a = torch.nn.Linear(5, 3)
        self.b = torch.nn.Linear(5, 3)

    def forward(self, x, use_b: bool):
        return self.a(x) + (self.b(x) if use_b else 0.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("bucket_bytes", [48, 1 << 20], ids=["small-buckets", "one-bucket"])
def test_accumulation_without_no_sync_and_zero_grad_between(mode, stage, bucket_bytes):
    """Backward three times per step, a branch unused in some of them, with and without a
    zero_grad() that drops the first micro-batch: the same parameters as the DDP-style
    reference that accumulates the same gradients."""
    comm = mpicomm.init()
    model, ref = Gated(), Gated()
    opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), stage=stage, comm=comm, bucket_bytes=bucket_bytes,
                        lr=0.02)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.02)
    for s in range(3):
        opt.zero_grad()
        ropt.zero_grad()
        for m in range(3):
            g = torch.Generator().manual_seed(1000 * s + 10 * m + comm.rank)
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            use_b = m != 1                               # the same choice on every rank
            for net in (model, ref):
                torch.nn.functional.mse_loss(net(x, use_b), y).backward()
            if s == 1 and m == 0:                        # this micro-batch is dropped
                opt.zero_grad()
                ropt.zero_grad()
        for p in ref.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        averaged_grads(ref)
        opt.step()
        ropt.step()
        if stage == 2:
            assert_all(all(p.grad is None for p in model.parameters()), "stage 2 released the gradients")
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close_all(p, q, atol=1e-5, what=f"stage {stage} after accumulation without no_sync")


def test_stage3_is_refused_pointing_to_fsdp2_and_other_stages_named():
    comm = mpicomm.init()
    p = list(make_model().parameters())
    with pytest.raises(ValueError, match=r"stage 3.*fully_shard.*ckpt\.save"):
        ZeroOptimizer(torch.optim.Adam, p, stage=3, comm=comm, lr=0.1)
    for bad in (0, 4, "1"):
        with pytest.raises(ValueError, match=r"expected stage in \(1, 2\)"):
            ZeroOptimizer(torch.optim.Adam, p, stage=bad, comm=comm, lr=0.1)


@pytest.mark.parametrize("mode", MODES)
def test_stage2_overlap_off_accumulates_without_no_sync(mode):
    """Without overlap nothing leaves during backward, so plain accumulation is right at stage 2
    too; the gradients are released when step() sends them."""
    comm = mpicomm.init()
    model, ref = make_model(), make_model()
    opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), stage=2, comm=comm, bucket_bytes=48,
                        overlap=False, lr=0.02)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.02)
    for s in range(3):
        opt.zero_grad()
        ropt.zero_grad()
        for m in range(2):
            loss_of(model, s, m, comm.rank).backward()
            loss_of(ref, s, m, comm.rank).backward()
        averaged_grads(ref)
        opt.step()
        ropt.step()
        assert_all(all(p.grad is None for p in model.parameters()), "grads released by step()")
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close_all(p, q, atol=1e-5, what="stage 2 without overlap, accumulated")
