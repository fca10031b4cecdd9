"""ZeroOneAdam against references: torch.optim.Adam while every step is a variance step, and a
float64 simulation of 0/1 Adam written here (``simulate`` of test_cmp_backend, i.e. plain
allreduce, standing in for each 1-bit allreduce); bytes per step; non-finite gradients;
hyperparameter checks; the ZeroOptimizer refusal."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

import compressed
from mpitest import assert_all, check_all
from test_cmp_adam import make_params, mean_over, rank_grads
from test_cmp_backend import simulate
from test_cmp_wire import CountingCommunicator


# ---- the float64 simulation -----------------------------------------------------------------------
class CompressedMean:
    """The 1-bit mean of flat float64 vectors with error feedback per key (plain allreduce inside)."""

    def __init__(self, sub: MPI.Comm) -> None:
        self.sub, self.errors = sub, {}

    def __call__(self, parts: list[np.ndarray], key: str) -> list[np.ndarray]:
        flat = np.concatenate([a.reshape(-1) for a in parts])
        if self.sub.size > 1:
            N = compressed.padded_size(flat.size, self.sub.size)
            we, se = self.errors.get(key, (np.zeros(N), np.zeros(N // self.sub.size)))
            res = simulate(flat, we, se, self.sub)
            self.errors[key] = (res["we"], res["se"])
            flat = res["out"]
        out, off = [], 0
        for a in parts:
            out.append(flat[off:off + a.size].reshape(a.shape))
            off += a.size
        return out


def exact_mean(sub: MPI.Comm, parts: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for a in parts:
        s = np.empty_like(a)
        sub.Allreduce(np.ascontiguousarray(a), s, op=MPI.SUM)
        out.append(s / sub.size)
    return out


def simulate_zoadam(sub, x, grads, steps, *, lr, betas, eps, wd, var_freeze_step, var_update_scaler,
                    local_step_scaler, local_step_clipper):
    """0/1 Adam in float64, from the algorithm's text; returns (params per step, rounds)."""
    b1, b2 = betas
    x = [a.astype(np.float64).copy() for a in x]
    m = [np.zeros_like(a) for a in x]
    v = [np.zeros_like(a) for a in x]
    acc = [np.zeros_like(a) for a in x]
    cmean = CompressedMean(sub)
    var_interval, var_counter, n_var = 1, 0, 0
    interval, counter, lrs = 1, 0, 0.0
    history, rounds = [], []
    for t in range(1, steps + 1):
        g = [gi.astype(np.float64) + wd * xi for gi, xi in zip(grads(t - 1), x)]
        bc1 = 1 - b1 ** t
        if t <= var_freeze_step:
            var = t % var_interval == 0
            g = exact_mean(sub, g) if var else cmean(g, "grad")
            m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
            if var:
                v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
                n_var += 1
            bc2 = 1 - b2 ** n_var
            x = [xi - lr / bc1 * mi / (np.sqrt(vi / bc2) + eps) for xi, mi, vi in zip(x, m, v)]
            if var:
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
            rounds.append("exact" if var else "compressed")
        else:
            bc2 = 1 - b2 ** n_var if n_var else 1.0
            den = [np.sqrt(vi / bc2) + eps for vi in v]
            m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
            step = lr / bc1
            x = [xi - step * mi / d for xi, mi, d in zip(x, m, den)]
            acc = [a - step * mi / d for a, mi, d in zip(acc, m, den)]
            lrs += step
            if t % interval == 0:
                mean = cmean([a * d for a, d in zip(acc, den)], "update")
                x = [xi - a + mu / d for xi, a, mu, d in zip(x, acc, mean, den)]
                m = [-mu / lrs for mu in mean]
                acc = [np.zeros_like(a) for a in acc]
                lrs = 0.0
                rounds.append("sync")
            else:
                rounds.append("local")
            counter += 1
            if counter == local_step_scaler:
                counter, interval = 0, min(local_step_clipper, interval * 2)
        history.append([a.copy() for a in x])
    return history, rounds


SCHEDULE = dict(var_freeze_step=7, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
#: the schedule above, written out: variance steps 1, 2, 4, 6; local steps after 7 at doubling intervals
ROUNDS = ["exact", "exact", "compressed", "exact", "compressed", "exact", "compressed",
          "sync", "sync", "sync", "local", "sync", "local", "local", "local", "sync"]


def _grads(rank: int, params):
    return lambda step: [g.numpy() + 0.1 * rank for g in rank_grads(step, rank, params)]


# ---- tests ----------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_variance_steps_are_adam_on_averaged_gradients(world, comm):
    def run():
        ps, ref_ps = make_params(), make_params()
        opt = compressed.ZeroOneAdam(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, comm=comm)
        ref = torch.optim.Adam(ref_ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
        for step in range(6):   # var_update_scaler=16: the first 16 steps update the variance
            for p, q, g in zip(ps, ref_ps, rank_grads(step, comm.rank, ps)):
                p.grad = g.clone()
                q.grad = mean_over(world, g)
            opt.step()
            ref.step()
            assert opt.last_round == "exact"
        for p, q in zip(ps, ref_ps):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
def test_every_step_matches_the_float64_simulation(world, comm):
    def run():
        ps = make_params(7)
        x0 = [p.detach().numpy().copy() for p in ps]
        kw = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-8, wd=0.01)
        opt = compressed.ZeroOneAdam(ps, lr=kw["lr"], betas=kw["betas"], eps=kw["eps"],
                                     weight_decay=kw["wd"], comm=comm, **SCHEDULE)
        grads = _grads(comm.rank, ps)
        history, rounds = simulate_zoadam(world, x0, grads, len(ROUNDS), **kw, **SCHEDULE)
        assert rounds == ROUNDS
        got = []
        for t in range(len(ROUNDS)):
            for p, g in zip(ps, grads(t)):
                p.grad = torch.from_numpy(g.astype(np.float32))
            opt.step()
            got.append(opt.last_round)
            if opt.last_round == "sync":   # the same weights, bit for bit, on every rank
                flat = torch.cat([p.detach().reshape(-1) for p in ps]).numpy()
                assert all(np.array_equal(flat, o) for o in world.allgather(flat)), f"step {t + 1}"
            for p, want in zip(ps, history[t]):
                np.testing.assert_allclose(p.detach().double().numpy(), want, rtol=1e-4, atol=1e-5,
                                           err_msg=f"step {t + 1} ({ROUNDS[t]})")
        assert got == ROUNDS
        assert (opt.var_interval, opt.local_step_interval) == (4, 4)

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
def test_bytes_per_step_show_the_skipped_rounds(world):
    def run():
        counting = CountingCommunicator(world)
        p = counting.size
        model = torch.nn.Linear(64, 64)
        n = sum(q.numel() for q in model.parameters())
        opt = compressed.ZeroOneAdam(model.parameters(), lr=1e-3, comm=counting, **SCHEDULE)
        sent = {}
        for t in range(len(ROUNDS)):
            gen = torch.Generator().manual_seed(10 * t + counting.rank)
            for q in model.parameters():
                q.grad = torch.randn(q.shape, generator=gen)
            before = counting.sent
            opt.step()
            sent.setdefault(opt.last_round, set()).add(counting.sent - before)
        ring = 2 * (p - 1) * 4 * n // p
        assert sent["exact"] == {ring}, sent
        assert sent["local"] == {0}, sent
        for kind in ("compressed", "sync"):
            (b,) = sent[kind]
            assert (b == 0) if p == 1 else (0 < b < ring / 20), (kind, b, ring)

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
def test_non_finite_gradient_in_a_local_step_raises_everywhere_at_the_sync(world, comm):
    def run():
        ps = make_params(2)
        opt = compressed.ZeroOneAdam(ps, lr=0.01, comm=comm, var_freeze_step=2, var_update_scaler=1,
                                     local_step_scaler=1, local_step_clipper=4)
        rounds = []
        for t in range(8):
            for p, g in zip(ps, rank_grads(t, comm.rank, ps)):
                if t == 4 and comm.rank == 0:
                    g[0] = float("nan")
                p.grad = g
            if t == 7:   # step 8: the sync of the interval of 4 that step 5 started
                before = [p.detach().clone() for p in ps]
                with pytest.raises(compressed.NonFiniteError):
                    opt.step()
                assert all(torch.equal(p, b) for p, b in zip(ps, before)), "the failed sync changed weights"
            else:
                opt.step()
                rounds.append(opt.last_round)
                assert all(bool(torch.isfinite(p).all()) for p in ps)
        assert rounds == ["exact", "exact", "sync", "sync", "local", "local", "local"], rounds

    check_all(run, world)


@pytest.mark.parametrize("kwargs,name", [
    (dict(var_update_scaler=0), "var_update_scaler"), (dict(local_step_scaler=0), "local_step_scaler"),
    (dict(local_step_clipper=0), "local_step_clipper"), (dict(var_freeze_step=-1), "var_freeze_step"),
    (dict(lr=-1.0), "lr"), (dict(betas=(1.0, 0.9)), r"betas\[0\]"), (dict(eps=-1e-8), "eps"),
    (dict(weight_decay=-0.1), "weight_decay")])
def test_hyperparameters_out_of_range(kwargs, name):
    with pytest.raises(ValueError, match=f"ZeroOneAdam: {name} must be"):
        compressed.ZeroOneAdam(make_params(), **kwargs)


@pytest.mark.parametrize("cls", ["ZeroOneAdam", "OnebitLamb"])
def test_zero_optimizer_refuses_them_saying_why(cls):
    from zero import ZeroOptimizer

    with pytest.raises(TypeError, match=f"cannot shard {cls}: .*(local steps|trust ratio)"):
        ZeroOptimizer(getattr(compressed, cls), make_params(), lr=1e-3)


@pytest.mark.mpi(min_size=1)
def test_world_size_one_compresses_nothing(world):
    sub = world.Split(world.rank, 0)

    def run():
        ps = make_params(4)
        opt = compressed.ZeroOneAdam(ps, lr=0.01, comm=sub, **SCHEDULE)
        for t in range(len(ROUNDS)):
            for p, g in zip(ps, rank_grads(t, 0, ps)):
                p.grad = g
            opt.step()
        assert opt.onebit.compressor.calls == 0

    check_all(run, world)
    assert_all(True)
