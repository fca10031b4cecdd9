"""OnebitAdam: Adam during warm-up, compressed momentum after freeze_step, state round trip, convergence."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from mpi4py import MPI

import compressed
from mpitest import check_all
from test_cmp_backend import group, simulate


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 6, generator=g)),
            torch.nn.Parameter(torch.randn(6, generator=g)),
            torch.nn.Parameter(torch.randn(3, generator=g))]


def rank_grads(step: int, rank: int, params) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(p.shape, generator=g) * (1 + rank) for p in params]


def mean_over(world: MPI.Comm, t: torch.Tensor) -> torch.Tensor:
    a = t.double().numpy().copy()
    world.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
    return torch.from_numpy(a / world.size).float()


@pytest.mark.mpi(min_size=1)
def test_warmup_is_adam_on_averaged_gradients(world, comm):
    def run():
        ps, ref_ps = make_params(), make_params()
        opt = compressed.OnebitAdam(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1,
                                    freeze_step=10, comm=comm)
        ref = torch.optim.Adam(ref_ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
        for step in range(5):
            for p, q, g in zip(ps, ref_ps, rank_grads(step, comm.rank, ps)):
                p.grad = g.clone()
                q.grad = mean_over(world, g)
            opt.step()
            ref.step()
            assert not opt.frozen
        for p, q in zip(ps, ref_ps):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
def test_frozen_step_averages_momentum_with_one_compressed_call(world, comm):
    def run():
        lr, (b1, b2), eps, freeze = 0.05, (0.9, 0.999), 1e-8, 2
        ps = make_params(3)
        opt = compressed.OnebitAdam(ps, lr=lr, betas=(b1, b2), eps=eps, freeze_step=freeze, comm=comm)
        for step in range(freeze):
            for p, g in zip(ps, rank_grads(step, comm.rank, ps)):
                p.grad = g
            opt.step()
        assert opt.frozen
        before = [p.detach().clone() for p in ps]
        m0 = [opt.state[p]["exp_avg"].clone() for p in ps]
        v0 = [opt.state[p]["exp_avg_sq"].clone() for p in ps]
        grads = rank_grads(freeze, comm.rank, ps)
        for p, g in zip(ps, grads):
            p.grad = g
        calls = opt.onebit.compressor.calls
        opt.step()
        # independent expectation: local momentum, flattened, one compressed mean (errors zero)
        local = torch.cat([(b1 * m + (1 - b1) * g).reshape(-1) for m, g in zip(m0, grads)])
        n = local.numel()
        N = compressed.padded_size(n, comm.size)
        if comm.size > 1:
            mean = simulate(local.numpy(), np.zeros(N), np.zeros(N // comm.size), world)["out"]
            assert opt.onebit.compressor.calls == calls + 1
        else:
            mean = local.double().numpy()
        t = freeze + 1
        off = 0
        for p, p0, v, m in zip(ps, before, v0, m0):
            k = p.numel()
            mhat = torch.from_numpy(mean[off:off + k]).view(p.shape)
            off += k
            want = p0.double() - lr / (1 - b1 ** t) * mhat / (
                v.double().sqrt() / (1 - b2 ** freeze) ** 0.5 + eps)
            torch.testing.assert_close(p.detach().double(), want, rtol=1e-4, atol=1e-5)
            assert torch.equal(opt.state[p]["exp_avg_sq"], v), "variance must stay frozen"
            torch.testing.assert_close(opt.state[p]["exp_avg"].double(), mhat, rtol=1e-5, atol=1e-6)

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
def test_state_dict_round_trip_with_error_buffers(world, comm):
    def run():
        ps = make_params(5)
        opt = compressed.OnebitAdam(ps, lr=0.02, freeze_step=2, comm=comm)

        def step(o, params, k):
            for p, g in zip(params, rank_grads(k, comm.rank, params)):
                p.grad = g
            o.step()

        for k in range(4):
            step(opt, ps, k)
        sd = opt.state_dict()
        mine = copy.deepcopy(opt.per_rank_state_dict())
        assert sd["onebit"] == {"global_step": 4, "freeze_step": 2}
        if comm.size > 1:
            errs = mine["allreduce"]["errors"]
            assert len(errs) == 1 and any(e["worker_error"].abs().sum() > 0 for e in errs.values())
        ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        opt2 = compressed.OnebitAdam(ps2, lr=0.02, freeze_step=1000, comm=comm)
        opt2.load_state_dict(copy.deepcopy(sd))  # as if saved and loaded
        opt2.load_per_rank_state_dict(world.allgather(mine), comm.rank, comm.size)
        assert opt2.freeze_step == 2 and opt2.global_step == 4
        for k in range(4, 7):
            step(opt, ps, k)
            step(opt2, ps2, k)
        for p, q in zip(ps, ps2):
            assert torch.equal(p, q)

    check_all(run, world)


# ---- convergence --------------------------------------------------------------------------------
_G = torch.Generator().manual_seed(1234)
_W1 = torch.randn(16, 4, generator=_G)
_W2 = torch.randn(16, generator=_G) * 0.5


def _target(x: torch.Tensor) -> torch.Tensor:
    return (x @ _W2).unsqueeze(1) + 0.5 * torch.tanh(x @ _W1).sum(1, keepdim=True)


def _held_out(noise: float = 0.3):
    gen = torch.Generator().manual_seed(999)
    x = torch.randn(2048, 16, generator=gen)
    return x, _target(x) + noise * torch.randn(2048, 1, generator=gen)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def _train(optimizer: str, comm, seed: int = 1, steps: int = 400, lr: float = 1e-2,
           freeze: int = 100) -> float:
    """Minibatch regression (label noise 0.3) on this rank's data stream.

    Returns the final loss: the held-out loss averaged over 5 points of the last 50 steps
    (smooths the iterate noise of a constant learning rate).
    """
    model = _model(seed)
    gen = torch.Generator().manual_seed(100 + 10 * seed + comm.rank)
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        opt = compressed.OnebitAdam(model.parameters(), lr=lr, freeze_step=freeze, comm=comm)
    xt, yt = _held_out()
    finals = []
    for step in range(steps):
        x = torch.randn(64, 16, generator=gen)
        y = _target(x) + 0.3 * torch.randn(64, 1, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if optimizer == "adam":
            for p in model.parameters():
                comm.all_reduce(p.grad, op="avg")
        opt.step()
        if step >= steps - 50 and step % 10 == 9:
            with torch.no_grad():
                finals.append(float(torch.nn.functional.mse_loss(model(xt), yt)))
    return sum(finals) / len(finals)


@pytest.mark.mpi(min_size=2)
def test_converges_like_adam_at_two_ranks(world):
    sub, comm2 = group(world, 2)

    def run():
        if comm2 is None:
            return
        xt, yt = _held_out()
        with torch.no_grad():
            initial = float(torch.nn.functional.mse_loss(_model(1)(xt), yt))
        adam = _train("adam", comm2)
        onebit = _train("onebit", comm2)
        assert adam < initial / 10, f"plain Adam did not learn: {initial} -> {adam}"
        assert abs(onebit - adam) <= 0.05 * adam, f"OnebitAdam {onebit} vs Adam {adam}"

    check_all(run, world)
