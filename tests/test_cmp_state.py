"""1-bit state across checkpoints: exact resume at the same size, error mass carried to another.

The resharding rule is tested with fake ranks (no communication) against float64 numpy, and a
resharded state is run against the float64 plain-allreduce simulation of ``test_cmp_backend``
with the errors the rule prescribes (computed here, independently, in numpy).
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from mpi4py import MPI

import compressed
from compressed import reshard
from mpitest import check_all
from test_cmp_backend import compare, group, simulate


def fake_saved(p: int, keys: dict[str, int], seed: int = 0) -> list[dict]:
    """Per-rank states of an OnebitAllreduce at ``p`` ranks with random errors."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(p):
        errors = {}
        for key, n in keys.items():
            N = compressed.padded_size(n, p)
            errors[key] = {"numel": n,
                           "worker_error": torch.from_numpy(rng.standard_normal(N).astype(np.float32)),
                           "server_error": torch.from_numpy(rng.standard_normal(N // p).astype(np.float32))}
        out.append({"world_size": p, "errors": errors})
    return out


def rule_numpy(saved: list[dict], key: str, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The documented rule, written out in float64 numpy."""
    n = saved[0]["errors"][key]["numel"]
    we = np.mean([s["errors"][key]["worker_error"].numpy()[:n].astype(np.float64) for s in saved], axis=0)
    se = np.concatenate([s["errors"][key]["server_error"].numpy() for s in saved])[:n]
    N = compressed.padded_size(n, size)
    we_full, se_full = np.zeros(N), np.zeros(N)
    we_full[:n], se_full[:n] = we, se
    chunk = N // size
    return we_full, se_full[rank * chunk:(rank + 1) * chunk]


# ---- the rule, with fake ranks ------------------------------------------------------------------
@pytest.mark.parametrize("p,q", [(2, 4), (4, 2), (3, 1), (1, 3), (4, 3)])
def test_reshard_keeps_the_error_mass(p, q):
    keys = {"a": 1000, "b": 7}
    saved = fake_saved(p, keys, seed=p * 10 + q)
    new = [reshard.allreduce_state(saved, r, q) for r in range(q)]
    for key, n in keys.items():
        old_we = np.mean([s["errors"][key]["worker_error"].numpy()[:n].astype(np.float64) for s in saved], axis=0)
        new_we = np.mean([d["errors"][key]["worker_error"].numpy()[:n].astype(np.float64) for d in new], axis=0)
        np.testing.assert_allclose(new_we, old_we, rtol=1e-6, atol=1e-7)  # the mean the average owes
        old_se = np.concatenate([s["errors"][key]["server_error"].numpy() for s in saved])[:n]
        new_se = np.concatenate([d["errors"][key]["server_error"].numpy() for d in new])
        assert np.array_equal(new_se[:n], old_se) and not new_se[n:].any()  # per output position
        for r, d in enumerate(new):
            N = compressed.padded_size(n, q)
            assert d["world_size"] == q and d["errors"][key]["numel"] == n
            assert d["errors"][key]["worker_error"].numel() == N and not d["errors"][key]["worker_error"][n:].any()
            want_we, want_se = rule_numpy(saved, key, r, q)
            np.testing.assert_allclose(d["errors"][key]["worker_error"].numpy(), want_we, rtol=1e-6, atol=1e-7)
            np.testing.assert_array_equal(d["errors"][key]["server_error"].numpy(), want_se)


def test_reshard_same_size_is_the_saved_state():
    saved = fake_saved(3, {"a": 50})
    for r in range(3):
        assert reshard.allreduce_state(saved, r, 3) is saved[r]


def test_reshard_rejects_inconsistent_states():
    saved = fake_saved(2, {"a": 50})
    bad = copy.deepcopy(saved)
    bad[1]["errors"]["b"] = bad[1]["errors"].pop("a")
    with pytest.raises(ValueError, match="different keys"):
        reshard.allreduce_state(bad, 0, 3)
    bad = copy.deepcopy(saved)
    bad[1]["world_size"] = 3
    with pytest.raises(ValueError, match="world size 3"):
        reshard.allreduce_state(bad, 0, 3)
    bad = copy.deepcopy(saved)
    bad[0]["errors"]["a"]["worker_error"] = torch.zeros(5)
    with pytest.raises(ValueError, match="expected 64"):
        reshard.allreduce_state(bad, 0, 3)


# ---- hierarchical layouts, with fake ranks -------------------------------------------------------
def layout_of(nodes: int, per_node: int, placement: list[int]) -> tuple:
    """The layout of ranks placed on nodes by ``placement[r]`` (node of rank r), as
    compressed.hierarchical numbers them: part = index among the node's ranks, chunk = index
    among the ranks of that part (both in rank order)."""
    part = [placement[:r].count(nd) for r, nd in enumerate(placement)]
    chunk = [part[:r].count(j) for r, j in enumerate(part)]
    return nodes, per_node, list(zip(chunk, part))


def owed_numpy(states: list[dict], layout, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(worker error owed, server error) per position, in float64 numpy, written out per element."""
    n = states[0]["errors"][key]["numel"]
    p = len(states)
    P = compressed.padded_size(n, p)
    we = [st["errors"][key]["worker_error"].numpy().astype(np.float64) for st in states]
    se = [st["errors"][key]["server_error"].numpy().astype(np.float64) for st in states]
    if layout is None:
        return np.mean(we, axis=0)[:n], np.concatenate(se)[:n]
    nodes, per_node, positions = layout
    sub, chunk = P // per_node, P // per_node // nodes
    owed, server = np.zeros(P), np.zeros(P)
    for r, (c, j) in enumerate(positions):
        for k in range(sub):
            owed[j * sub + k] += we[r][k] / nodes
        for k in range(chunk):
            server[j * sub + c * chunk + k] = se[r][k]
    return owed[:n], server[:n]


def hier_saved(layout, keys: dict[str, int], seed: int) -> list[dict]:
    """Per-rank states of a hierarchical run (worker errors used in their first part only)."""
    nodes, per_node, positions = layout
    saved = fake_saved(nodes * per_node, keys, seed)
    for st, pos in zip(saved, positions):
        st["hierarchy"] = [nodes, per_node, *pos]
        for d in st["errors"].values():
            d["worker_error"][compressed.padded_size(d["numel"], nodes * per_node) // per_node:] = 0
    return saved


LAYOUTS = {"flat4": (4, None), "flat2": (2, None), "flat3": (3, None),
           "2x2 block": (4, layout_of(2, 2, [0, 0, 1, 1])),
           "2x2 round-robin": (4, layout_of(2, 2, [0, 1, 0, 1])),
           "2x2 odd": (4, layout_of(2, 2, [1, 0, 0, 1])),
           "3x2": (6, layout_of(3, 2, [0, 1, 2, 0, 1, 2])),
           "2x3": (6, layout_of(2, 3, [0, 0, 1, 0, 1, 1]))}


@pytest.mark.parametrize("before,after", [("2x2 block", "flat2"), ("2x2 block", "flat4"), ("flat4", "2x2 odd"),
                                          ("2x2 round-robin", "2x2 block"), ("3x2", "2x2 block"),
                                          ("flat3", "2x3"), ("2x3", "3x2")])
def test_reshard_across_layouts_keeps_the_error_mass_per_position(before, after):
    keys = {"a": 1000, "b": 7}
    (p, lay_p), (q, lay_q) = LAYOUTS[before], LAYOUTS[after]
    saved = hier_saved(lay_p, keys, seed=len(before) + 7 * len(after)) if lay_p else fake_saved(p, keys, seed=3)
    new = [reshard.allreduce_state(saved, r, q, lay_q) for r in range(q)]
    for key in keys:
        old_owed, old_server = owed_numpy(saved, lay_p, key)
        new_owed, new_server = owed_numpy(new, lay_q, key)
        np.testing.assert_allclose(new_owed, old_owed, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(new_server, old_server)
        for r, d in enumerate(new):
            n, N = keys[key], compressed.padded_size(keys[key], q)
            assert d["errors"][key]["worker_error"].numel() == N
            assert d["errors"][key]["server_error"].numel() == N // q
            assert d.get("hierarchy") == (None if lay_q is None else [lay_q[0], lay_q[1], *lay_q[2][r]])


def test_reshard_same_layout_is_the_saved_state_and_another_placement_is_not():
    lay = LAYOUTS["2x2 block"][1]
    saved = hier_saved(lay, {"a": 50}, seed=5)
    for r in range(4):
        assert reshard.allreduce_state(saved, r, 4, lay) is saved[r]
    moved = LAYOUTS["2x2 round-robin"][1]
    new = [reshard.allreduce_state(saved, r, 4, moved) for r in range(4)]
    assert all(d is not s for d, s in zip(new, saved))
    flat = [reshard.allreduce_state(saved, r, 4, None) for r in range(4)]
    assert all("hierarchy" not in d for d in flat)


def test_reshard_rejects_inconsistent_hierarchy_records():
    lay = LAYOUTS["2x2 block"][1]
    saved = hier_saved(lay, {"a": 50}, seed=6)
    bad = copy.deepcopy(saved)
    del bad[2]["hierarchy"]
    with pytest.raises(ValueError, match="hierarchical algorithm and others the flat"):
        reshard.allreduce_state(bad, 0, 2)
    bad = copy.deepcopy(saved)
    bad[3]["hierarchy"] = [2, 2, 0, 0]  # two ranks claim chunk 0 of part 0
    with pytest.raises(ValueError, match="do not describe 4 ranks"):
        reshard.allreduce_state(bad, 0, 2)


# ---- resharded state running against the simulation ---------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("saved_at", [1, 2, 3, 4])
def test_resharded_errors_continue_like_the_simulation(world, saved_at):
    """States saved at ``saved_at`` (fake) ranks load at every sub-world size; the next compressed
    means match the simulation started from the rule's errors."""
    def run():
        for q in range(2, world.size + 1):
            sub, comm = group(world, q)
            if sub is None:
                continue
            saved = fake_saved(saved_at, {"m": 999}, seed=7)
            ar = compressed.OnebitAllreduce(comm)
            ar.load_per_rank_state_dict(saved, comm.rank, q)
            if saved_at == q:  # the same size: this rank's own saved errors, padding included
                we, se = (saved[comm.rank]["errors"]["m"][k].numpy().astype(np.float64)
                          for k in ("worker_error", "server_error"))
            else:
                we, se = rule_numpy(saved, "m", comm.rank, q)
            rng = np.random.default_rng(comm.rank + 20)
            for _ in range(2):
                g = torch.from_numpy(rng.standard_normal(999).astype(np.float32))
                ref = simulate(g.numpy(), we, se, sub)
                we, se = ref["we"], ref["se"]
                compare(ar(g, key="m"), *ar.errors("m"), ref)

    check_all(run, world)


def all_saved(obj, world: MPI.Comm) -> list[dict]:
    """Every rank's per-rank state in rank order (what ckpt hands to load_per_rank_state_dict)."""
    return world.allgather(copy.deepcopy(obj.per_rank_state_dict()))


# ---- exact resume at the same size --------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kernels", ["numpy", "torch"])
def test_onebit_allreduce_resume_is_bit_identical(world, comm, kernels):
    def run():
        rng = np.random.default_rng(comm.rank)
        gs = [torch.from_numpy(rng.standard_normal(3000).astype(np.float32)) for _ in range(6)]
        ar = compressed.OnebitAllreduce(comm, kernels=kernels)
        for g in gs[:3]:
            ar(g, key="k")
        saved = all_saved(ar, world)
        after = [ar(g, key="k") for g in gs[3:]]
        ar2 = compressed.OnebitAllreduce(comm, kernels=kernels)
        ar2.load_per_rank_state_dict(saved, comm.rank, comm.size)
        for g, want in zip(gs[3:], after):
            assert torch.equal(ar2(g, key="k"), want)

    check_all(run, world)


def _params(dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(40, 30, generator=g).to(dtype)),
            torch.nn.Parameter(torch.randn(30, generator=g).to(dtype))]


def _step(opt, params, k: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 * k + rank)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * (1 + rank)).to(p.dtype)
    opt.step()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onebit_adam_resume_is_bit_identical(world, comm, dtype):
    """state_dict + per_rank_state_dict (what a checkpoint keeps) resume exactly, in warm-up
    (saved at step 2 of 3) and after it (saved at step 5)."""
    def run():
        for save_at in (2, 5):
            ps = _params(dtype)
            opt = compressed.OnebitAdam(ps, lr=0.01, freeze_step=3, comm=comm)
            for k in range(save_at):
                _step(opt, ps, k, comm.rank)
            sd, saved = copy.deepcopy(opt.state_dict()), all_saved(opt, world)
            assert sd["onebit"] == {"global_step": save_at, "freeze_step": 3}
            assert all(st["exp_avg"].dtype == torch.float32 for st in sd["state"].values())
            ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
            for k in range(save_at, 8):
                _step(opt, ps, k, comm.rank)
            opt2 = compressed.OnebitAdam(ps2, lr=0.01, freeze_step=100, comm=comm)
            opt2.load_state_dict(sd)
            opt2.load_per_rank_state_dict(saved, comm.rank, comm.size)
            assert opt2.global_step == save_at and opt2.freeze_step == 3
            for k in range(save_at, 8):
                _step(opt2, ps2, k, comm.rank)
            for p, q in zip(ps, ps2):
                assert p.dtype == dtype and torch.equal(p, q)

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
def test_ddp_state_resume(world, comm):
    def run():
        st = compressed.OnebitDDPState(comm, warmup_steps=0, min_bucket_numel=0)
        rng = np.random.default_rng(comm.rank + 5)
        gs = [torch.from_numpy(rng.standard_normal(500).astype(np.float32)) for _ in range(4)]
        for g in gs[:2]:
            st.allreduce(g, key="bucket0:500")
        st.step = 2
        saved = all_saved(st, world)
        want = [st.allreduce(g, key="bucket0:500") for g in gs[2:]]
        st2 = compressed.OnebitDDPState(comm)
        st2.load_per_rank_state_dict(saved, comm.rank, comm.size)
        assert st2.step == 2
        for g, w in zip(gs[2:], want):
            assert torch.equal(st2.allreduce(g, key="bucket0:500"), w)

    check_all(run, world)


# ---- bf16 / fp16 computed in fp32 ---------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_onebit_adam_low_precision_params_update_in_fp32(world, comm, dtype):
    """Warm-up steps equal fp32 Adam on the mean gradient computed from the rounded parameters,
    rounded once per step into the parameter (a float64 reference written out here)."""
    def run():
        lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
        ps = _params(dtype)
        opt = compressed.OnebitAdam(ps, lr=lr, betas=(b1, b2), eps=eps, freeze_step=10, comm=comm)
        ref = [p.detach().double() for p in ps]
        m = [torch.zeros_like(r) for r in ref]
        v = [torch.zeros_like(r) for r in ref]
        for k in range(4):
            g = torch.Generator().manual_seed(100 * k + comm.rank)
            for p in ps:
                p.grad = (torch.randn(p.shape, generator=g) * (1 + comm.rank)).to(dtype)
            grads = []
            for p in ps:
                a = p.grad.double().numpy().copy()
                world.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
                grads.append(torch.from_numpy(a / world.size))
            opt.step()
            t = k + 1
            for i, gr in enumerate(grads):
                m[i] = b1 * m[i] + (1 - b1) * gr
                v[i] = b2 * v[i] + (1 - b2) * gr * gr
                upd = lr / (1 - b1 ** t) * m[i] / (v[i].sqrt() / (1 - b2 ** t) ** 0.5 + eps)
                ref[i] = (ref[i] - upd).to(dtype).double()  # rounded once into the parameter
        for p, r in zip(ps, ref):
            # fp32 arithmetic vs float64: the rounded results agree up to one unit of the dtype
            ulp = torch.finfo(dtype).eps * r.abs().clamp_min(1e-3)
            assert ((p.double() - r).abs() <= ulp).all(), float((p.double() - r).abs().max())
        for k in range(4, 14):  # after freeze_step: compressed momentum, fp32 moments, finite
            _step(opt, ps, k, comm.rank)
        assert opt.frozen and all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in ps)
        assert all(torch.isfinite(p.float()).all() and p.dtype == dtype for p in ps)

    check_all(run, world)
