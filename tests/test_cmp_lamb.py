"""OnebitLamb against float64 references written here: LAMB with clamped trust ratios for the
warm-up, and 1-bit LAMB (``simulate`` of test_cmp_backend, i.e. plain allreduce, standing in
for the 1-bit allreduce) for the compressed steps; non-finite gradients; hyperparameter checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import compressed
from mpitest import check_all
from test_cmp_adam import rank_grads
from test_cmp_zoadam import CompressedMean, exact_mean

KW = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, max_coeff=5.0, min_coeff=0.05,
          coeff_beta=0.9, factor_max=4.0, factor_min=0.5, factor_threshold=0.1)


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    """Three tensors whose trust ratios land above, inside and below [min_coeff, max_coeff]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 6, generator=g) * 10),
            torch.nn.Parameter(torch.randn(6, generator=g)),
            torch.nn.Parameter(torch.randn(3, generator=g) * 0.002)]


def simulate_lamb(sub, x, grads, steps, freeze_step, *, lr, betas, eps, weight_decay, max_coeff,
                  min_coeff, coeff_beta, factor_max, factor_min, factor_threshold):
    """1-bit LAMB in float64 from the algorithm's text; returns (params per step, ratios per step)."""
    b1, b2, wd = betas[0], betas[1], weight_decay
    x = [a.astype(np.float64).copy() for a in x]
    m = [np.zeros_like(a) for a in x]
    v = [np.zeros_like(a) for a in x]
    frozen = [0.0] * len(x)
    last = [1.0] * len(x)
    fresh = scaling = None
    cmean = CompressedMean(sub)
    history, ratios = [], []
    for t in range(1, steps + 1):
        g = [gi.astype(np.float64) for gi in grads(t - 1)]
        cs = []
        if t <= freeze_step:
            g = exact_mean(sub, g)
            for i in range(len(x)):
                m[i] = b1 * m[i] + (1 - b1) * g[i]
                v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
                u = m[i] / (np.sqrt(v[i]) + eps) + wd * x[i]
                wn, un = np.linalg.norm(x[i]), np.linalg.norm(u)
                c = 1.0 if wn == 0 or un == 0 else float(np.clip(wn / un, min_coeff, max_coeff))
                if c != 1.0:
                    frozen[i] = coeff_beta * frozen[i] + (1 - coeff_beta) * c
                x[i] = x[i] - lr * c * u
                cs.append(c)
            if t == freeze_step:
                fresh = [a.copy() for a in v]
        else:
            if scaling is None:
                s = [np.linalg.norm(a) / np.sqrt(a.size) for a in m]
                scaling = [np.mean(s) / si for si in s]
            mean = cmean([(b1 * mi + (1 - b1) * gi) * sc for mi, gi, sc in zip(m, g, scaling)], "m")
            for i in range(len(x)):
                new = mean[i] / scaling[i]
                rebuilt = (new - b1 * m[i]) / (1 - b1)
                m[i] = new
                fresh[i] = b2 * fresh[i] + (1 - b2) * rebuilt ** 2
                den = np.sqrt(v[i]) + eps
                pre = m[i] / den
                u = pre + wd * x[i]
                f = np.max(den / (np.sqrt(fresh[i]) + eps))
                if wd > 0:
                    r = min(1.0, np.linalg.norm(pre) / np.linalg.norm(u))
                    f = f * r + (1 - r)
                f = min(max(f, factor_min), factor_max)
                f = min(max(f, last[i] * (1 - factor_threshold)), last[i] * (1 + factor_threshold))
                last[i] = f
                c = frozen[i] * f
                x[i] = x[i] - lr * c * u
                cs.append(c)
        history.append([a.copy() for a in x])
        ratios.append(cs)
    return history, ratios


def _grads(rank: int, params):
    return lambda step: [g.numpy() + 0.1 * rank for g in rank_grads(step, rank, params)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("freeze_step,steps", [(8, 8), (3, 9)])   # warm-up alone; then compressed
def test_matches_the_float64_reference(world, comm, freeze_step, steps):
    def run():
        ps = make_params(1)
        grads = _grads(comm.rank, ps)
        history, ratios = simulate_lamb(world, [p.detach().numpy() for p in ps], grads, steps,
                                        freeze_step, **KW)
        warm = [c for cs in ratios[:freeze_step] for c in cs]
        assert KW["max_coeff"] in warm and KW["min_coeff"] in warm, "test data must clamp both ways"
        assert any(KW["min_coeff"] < c < KW["max_coeff"] for c in warm)
        opt = compressed.OnebitLamb(ps, freeze_step=freeze_step, comm=comm, **KW)
        for t in range(steps):
            for p, g in zip(ps, grads(t)):
                p.grad = torch.from_numpy(g.astype(np.float32))
            opt.step()
            np.testing.assert_allclose(opt.get_lamb_coeffs(), ratios[t], rtol=1e-4, err_msg=f"step {t + 1}")
            for p, want in zip(ps, history[t]):
                np.testing.assert_allclose(p.detach().double().numpy(), want, rtol=1e-4, atol=1e-5,
                                           err_msg=f"step {t + 1}")
        assert opt.frozen == (steps >= freeze_step)

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
def test_non_finite_gradient_after_the_freeze_raises_everywhere_changing_nothing(world, comm):
    def run():
        ps = make_params(2)
        opt = compressed.OnebitLamb(ps, freeze_step=2, comm=comm, **KW)
        for t in range(3):
            for p, g in zip(ps, rank_grads(t, comm.rank, ps)):
                p.grad = g
            opt.step()
        before = [p.detach().clone() for p in ps]
        state = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
                 for p in ps}
        for p, g in zip(ps, rank_grads(3, comm.rank, ps)):
            if comm.rank == comm.size - 1:
                g.view(-1)[0] = float("inf")
            p.grad = g
        with pytest.raises(compressed.NonFiniteError):
            opt.step()
        assert opt.global_step == 3
        for p, b in zip(ps, before):
            assert torch.equal(p, b)
            for k, v in opt.state[p].items():
                assert torch.equal(v, state[id(p)][k]) if torch.is_tensor(v) else v == state[id(p)][k], k

    check_all(run, world)


@pytest.mark.parametrize("kwargs,name", [
    (dict(freeze_step=0), "freeze_step"), (dict(min_coeff=11.0), "min_coeff"),
    (dict(min_coeff=0.0), "min_coeff"), (dict(max_coeff=0.0), "max_coeff"),
    (dict(coeff_beta=1.0), "coeff_beta"), (dict(factor_max=0.9), "factor_max"),
    (dict(factor_min=0.0), "factor_min"), (dict(factor_min=1.5), "factor_min"),
    (dict(factor_threshold=-0.1), "factor_threshold"), (dict(lr=-1.0), "lr"),
    (dict(betas=(0.9, 1.0)), r"betas\[1\]")])
def test_hyperparameters_out_of_range(kwargs, name):
    with pytest.raises(ValueError, match=f"OnebitLamb: {name} must be"):
        compressed.OnebitLamb(make_params(), **kwargs)


def test_defaults_are_deepspeeds():
    opt = compressed.OnebitLamb(make_params())
    g = opt.param_groups[0]
    assert (opt.freeze_step, g["max_coeff"], g["min_coeff"], opt.coeff_beta, opt.factor_max,
            opt.factor_min, opt.factor_threshold) == (100000, 10.0, 0.01, 0.9, 4.0, 0.5, 0.1)
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    z = compressed.ZeroOneAdam(make_params())
    assert (z.var_freeze_step, z.var_update_scaler, z.local_step_scaler, z.local_step_clipper) == \
        (100000, 16, 32678, 16)
