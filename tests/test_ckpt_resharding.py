"""Save at N ranks, load at M ranks (any stage, dtype, optimizer), compare bit-exactly, train on.

World-size moves run on sub-communicators of the pytest world (sizes 1..4). Expected values come
from the saving run itself (model state, optimizer state gathered and unpadded here with numpy-
style slicing, not with ckpt's layout code) and from a plain single-process torch optimizer on
the full, unsharded model.
"""
from __future__ import annotations

import math
import time

import pytest
import torch
from mpi4py import MPI

import ckpt
from zero import ZeroOptimizer
import mpicomm
from mpitest import check_all

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
OPTIMIZERS = {
    "adam": (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99)}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
}
MOVES = [(2, 2), (4, 2), (2, 4), (3, 2), (1, 4), (4, 1), (1, 2), (2, 1)]
STEPS = 8


# -- model, data, training ---------------------------------------------------------------------

def make_model(dtype: torch.dtype, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # odd sizes: 35 + 7 + 28 + 4 = 74 elements, so both stages pad at 3 and 4 ranks
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 4)).to(dtype)


def batch(step: int, rank: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(3, 5, generator=g).to(dtype), torch.randn(3, 4, generator=g)


def backward(model: torch.nn.Module, step: int, rank: int, dtype: torch.dtype) -> None:
    x, y = batch(step, rank, dtype)
    torch.nn.functional.mse_loss(model(x).float(), y).backward()


def train(model, opt, steps: range, rank: int, dtype) -> None:
    for s in steps:
        opt.zero_grad()
        backward(model, s, rank, dtype)
        opt.step()


class Reference:
    """Plain torch optimizer on full fp32 masters; gradients of all ranks averaged here."""

    def __init__(self, model_state, masters, opt_name, state=None, groups=None):
        cls, kw = OPTIMIZERS[opt_name]
        dtype = next(iter(model_state.values())).dtype
        self.dtype = dtype
        self.model = make_model(dtype, seed=99)
        self.model.load_state_dict(model_state)
        self.masters = [m.clone() for m in masters]
        self.opt = cls(self.masters, **kw)
        if state is not None:
            self.opt.load_state_dict({"state": state, "param_groups": groups})

    def train(self, steps: range, world: int) -> None:
        params = list(self.model.parameters())
        for s in steps:
            total = [torch.zeros(p.shape) for p in params]
            for r in range(world):
                self.model.zero_grad()
                backward(self.model, s, r, self.dtype)
                for t, p in zip(total, params):
                    t += p.grad.float()
            for m, t in zip(self.masters, total):
                m.grad = t / world
            self.opt.step()
            with torch.no_grad():
                for p, m in zip(params, self.masters):
                    p.copy_(m)


# -- gathering the full, unpadded state of a ZeroOptimizer -------------------------------------

def _unpad(rows: torch.Tensor, numels, stage: int):
    world = rows.shape[0]
    if stage == 1:
        return list(rows.reshape(-1)[:sum(numels)].split(list(numels)))
    out, col = [], 0
    for n in numels:
        piece = math.ceil(n / world)
        out.append(rows[:, col:col + piece].reshape(-1)[:n])
        col += piece
    return out


def gather_full(opt: ZeroOptimizer, comm) -> dict:
    """{"master": [...], key: [...] per state tensor, "scalars": {key: [...]}} over all params."""
    full: dict = {"master": [], "scalars": {}}
    for gi, g in enumerate(opt.groups):
        numels = [p.numel() for p in g.params]
        local = g.master.numel()

        def gather(t):
            out = torch.empty(comm.size * local, dtype=t.dtype)
            comm.all_gather_into_tensor(out, t.contiguous())
            parts = _unpad(out.view(comm.size, local), numels, opt.stage)
            return [x.reshape(p.shape).clone() for x, p in zip(parts, g.params)]

        full["master"] += gather(g.master)
        for key, v in opt.shard_state(gi).items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == local:
                full.setdefault(key, []).extend(gather(v))
            else:
                value = v.item() if isinstance(v, torch.Tensor) else v
                full["scalars"].setdefault(key, []).extend([value] * len(numels))
    return full


def hyper(opt) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def snapshot(model, opt, comm) -> dict:
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "full": gather_full(opt, comm), "groups": hyper(opt)}


def plain_state(full: dict, groups) -> tuple[dict, list]:
    """A torch optimizer state_dict built from gathered full state."""
    state = {}
    keys = [k for k in full if k not in ("master", "scalars")]
    for i in range(len(full["master"])):
        st = {k: full[k][i].clone() for k in keys}
        for k, vals in full["scalars"].items():
            st[k] = torch.tensor(float(vals[i]))
        state[i] = st
    n = len(full["master"])
    return state, [{**groups[0], "params": list(range(n))}]


# -- comparisons --------------------------------------------------------------------------------

def assert_model_equal(model, expected: dict, what: str) -> None:
    got = model.state_dict()
    assert list(got) == list(expected), f"{what}: keys {list(got)} != {list(expected)}"
    for k, v in expected.items():
        assert got[k].dtype == v.dtype, f"{what}: {k} dtype {got[k].dtype} != {v.dtype}"
        assert torch.equal(got[k], v), f"{what}: {k} differs by {(got[k].float() - v.float()).abs().max()}"


def assert_full_equal(got: dict, expected: dict, what: str) -> None:
    assert set(got) == set(expected), f"{what}: state keys {sorted(got)} != {sorted(expected)}"
    assert set(got["scalars"]) == set(expected["scalars"]), \
        f"{what}: scalar keys {sorted(got['scalars'])} != {sorted(expected['scalars'])}"
    for key in expected:
        if key == "scalars":
            for k, vals in expected["scalars"].items():
                assert got["scalars"][k] == vals, f"{what}: scalar {k} {got['scalars'][k]} != {vals}"
            continue
        assert len(got[key]) == len(expected[key]), \
            f"{what}: {len(got[key])} tensors for {key}, expected {len(expected[key])}"
        for i, (a, b) in enumerate(zip(got[key], expected[key])):
            assert a.dtype == b.dtype and a.shape == b.shape, \
                f"{what}: {key}[{i}] {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
            assert torch.equal(a, b), f"{what}: {key}[{i}] differs by {(a - b).abs().max()}"


def assert_masters_close(got, expected, exact: bool, what: str) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        if exact:
            assert torch.equal(a, b), f"{what}: master {i} differs by {(a - b).abs().max()}"
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: master {i}: {m}")


def polite_barrier(world: MPI.Comm) -> None:
    """Barrier that sleeps instead of spinning, so idle ranks leave the cores to working ones."""
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def sub(world: MPI.Comm, n: int):
    """mpicomm Communicator over world ranks [0, n), or None on the other ranks."""
    c = world.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)
    return None if c == MPI.COMM_NULL else mpicomm.Communicator(c)


def free(*comms) -> None:
    for c in comms:
        if c is not None:
            c.mpi_comm.Free()


def _move_params():
    out = []
    for n, m in MOVES:
        marks = [pytest.mark.mpi(min_size=max(n, m))]
        if (n, m) in ((1, 2), (2, 1)):  # for runs at 2 ranks; larger runs have the bigger moves
            marks.append(pytest.mark.skipif(MPI.COMM_WORLD.size > 3, reason="covered by larger moves"))
        out.append(pytest.param((n, m), id=f"{n}to{m}", marks=marks))
    return out


# -- the matrix ---------------------------------------------------------------------------------

@pytest.mark.parametrize("move", _move_params())
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_reshard(world, shared_tmp_path, dtype_name, stage, opt_name, move):
    dtype = DTYPES[dtype_name]
    cls, kw = OPTIMIZERS[opt_name]
    n_save, n_load = move
    path = str(shared_tmp_path / "ck")
    save_c, load_c = sub(world, n_save), sub(world, n_load)

    ref = None
    if save_c is not None:
        model = make_model(dtype, seed=1)
        opt = ZeroOptimizer(cls, model.parameters(), stage=stage, comm=save_c, **kw)
        train(model, opt, range(STEPS), save_c.rank, dtype)
        ckpt.save(path, model=model, optimizer=opt, step=STEPS, comm=save_c, extra={"move": [n_save, n_load]})
        ref = snapshot(model, opt, save_c)
    polite_barrier(world)
    ref = world.bcast(ref, root=0)  # test-side transport of the expected values

    def check():
        if load_c is None:
            return
        r = load_c.rank
        other = 2 if stage == 1 else 1
        # (a) same stage, with optimizer state; then train on and compare with a plain optimizer
        model = make_model(dtype, seed=2)
        opt = ZeroOptimizer(cls, model.parameters(), stage=stage, comm=load_c, **{**kw, "lr": 0.5})
        info = ckpt.load(path, model=model, optimizer=opt, comm=load_c)
        assert (info.step, info.extra, info.world_size, info.stage) == \
            (STEPS, {"move": [n_save, n_load]}, n_save, stage)
        assert_model_equal(model, ref["model"], "model after load")
        assert_full_equal(gather_full(opt, load_c), ref["full"], "optimizer after load")
        assert hyper(opt) == ref["groups"], f"param_groups {hyper(opt)} != {ref['groups']}"
        state, groups = plain_state(ref["full"], ref["groups"])
        reference = Reference(ref["model"], ref["full"]["master"], opt_name, state, groups)
        train(model, opt, range(STEPS, 2 * STEPS), r, dtype)
        reference.train(range(STEPS, 2 * STEPS), n_load)
        assert_masters_close(gather_full(opt, load_c)["master"], reference.masters, n_load <= 2, "after 8 more steps")

        # (b) the other stage, with optimizer state
        model = make_model(dtype, seed=3)
        opt = ZeroOptimizer(cls, model.parameters(), stage=other, comm=load_c, **kw)
        ckpt.load(path, model=model, optimizer=opt, comm=load_c)
        assert_model_equal(model, ref["model"], f"model after load at stage {other}")
        assert_full_equal(gather_full(opt, load_c), ref["full"], f"optimizer after load at stage {other}")

        # (c) model only, then a fresh optimizer
        model = make_model(dtype, seed=4)
        info = ckpt.load(path, model=model, comm=load_c)
        assert not info.optimizer_loaded
        assert_model_equal(model, ref["model"], "model-only load")
        opt = ZeroOptimizer(cls, model.parameters(), stage=stage, comm=load_c, **kw)
        reference = Reference(ref["model"], [p.detach().float() for p in model.parameters()], opt_name)
        train(model, opt, range(STEPS, 2 * STEPS), r, dtype)
        reference.train(range(STEPS, 2 * STEPS), n_load)
        assert_masters_close(gather_full(opt, load_c)["master"], reference.masters, n_load <= 2,
                             "model-only load, 8 more steps")

    def check_then_wait():
        try:
            check()
        finally:
            polite_barrier(world)

    check_all(check_then_wait, world)
    free(save_c, load_c)
