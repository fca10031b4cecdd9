"""State items (``state=``), ``ckpt.RNG``, ``ckpt.PerRank`` and the per-rank protocol; nothing of an
optimizer's ``state_dict()`` left out; resume in fresh processes bit-identical to the run that
went on; format version 1 checkpoints still load.

References: the objects' own ``state_dict()`` before the save, the uninterrupted run's losses,
and for the version-1 checkpoint in tests/data the bytes it stores (bit for bit) and the same
training recomputed here (within rounding: another CPU may round differently).
"""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
from mpicomm import clean_env
import torch
from mpi4py import MPI

import ckpt
from zero import ZeroOptimizer
from ckpt import cli as ckpt_cli
from ckpt.tree import decode, encode
from conftest import single_process
from mpitest import assert_all, mpiexec_cmd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def same(a, b) -> bool:
    """Deep equality: tensors equal in dtype, shape and bits; containers element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return type(a) is type(b) and a == b


def test_tree_round_trip_and_refusal():
    value = {"a": [1, 2.5, None, "s", True], 3: (torch.arange(4, dtype=torch.int16), {"n": float("nan")}),
             "@tensor": torch.ones(2, 2, dtype=torch.bfloat16), (1, 2): float("-inf"), "np": np.float32(1.5)}
    tensors: list[torch.Tensor] = []
    data = encode(value, "v", tensors)
    back = decode(json.loads(json.dumps(data)), tensors)
    want = dict(value, np=1.5)
    assert same(back, want), back
    with pytest.raises(ckpt.CheckpointError, match=r"v\.x\[1\]: cannot store a builtins\.object"):
        encode({"x": [1, object()]}, "v", [])


class Custom(torch.optim.Optimizer):
    """Momentum SGD with every kind of state an optimizer may keep: int and 0-d tensor scalars,
    a per-parameter tensor of another shape, and top-level entries of its own (tensors and data)."""

    elementwise = True  # ZeroOptimizer may shard it: every update is element by element

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})
        self.calls = 0
        self.history = {"t": torch.zeros(3), "note": "none"}

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        self.history["t"][self.calls % 3] += 1
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                st["count"] = st.get("count", 0) + 1
                st["step"] = torch.tensor(float(self.calls))
                st["norms"] = torch.stack([p.grad.norm(), p.grad.abs().max()])
                st["buf"] = st.get("buf", torch.zeros_like(p)) * 0.9 + p.grad
                p.add_(st["buf"], alpha=-g["lr"])

    def state_dict(self):
        return {**super().state_dict(), "calls": self.calls, "history": self.history}

    def load_state_dict(self, state_dict) -> None:
        sd = dict(state_dict)
        self.calls, self.history = sd.pop("calls"), sd.pop("history")
        super().load_state_dict(sd)


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "custom": lambda ps: Custom(ps),
}


def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_state_dict_comes_back_whole(comm, world, shared_tmp_path, name):
    model = small_model(0)
    opt = OPTIMIZERS[name](model.parameters())
    for s in range(3):
        opt.zero_grad()
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(s))).square().sum().backward()
        opt.step()
    saved = opt.state_dict()
    ckpt.save(shared_tmp_path / "c", model=model, optimizer=opt, step=3, comm=comm)
    other = small_model(1)
    opt2 = OPTIMIZERS[name](other.parameters())
    ckpt.load(shared_tmp_path / "c", model=other, optimizer=opt2, comm=comm)
    assert_all(same(opt2.state_dict(), saved), f"{name}: {opt2.state_dict()} != {saved}")
    if name == "custom":  # what a ZeroOptimizer cannot take is refused, not dropped
        other = small_model(1)
        zero = ZeroOptimizer(Custom, other.parameters(), stage=1, comm=comm)
        with pytest.raises(ckpt.IncompatibleStateError, match="a ZeroOptimizer cannot take"):
            ckpt.load(shared_tmp_path / "c", model=other, optimizer=zero, comm=comm)


class LocalAdam(torch.optim.Adam):
    """Adam with per-rank state of its own (like error feedback): the per-rank protocol."""

    def __init__(self, params, rank: int) -> None:
        super().__init__(params, lr=0.01)
        self.local = torch.full((3,), float(rank))
        self.seen = None

    def per_rank_state_dict(self):
        return {"local": self.local, "ticks": int(self.local.sum())}

    def load_per_rank_state_dict(self, saved, rank, size) -> None:
        self.seen = [int(s["ticks"]) for s in saved]
        self.local = saved[rank]["local"].clone()


@pytest.mark.mpi(min_size=1)
def test_optimizer_with_per_rank_state(comm, world, shared_tmp_path):
    rank, size = world.Get_rank(), world.Get_size()
    model = small_model(0)
    opt = LocalAdam(model.parameters(), rank)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    ckpt.save(shared_tmp_path / "p", model=model, optimizer=opt, comm=comm)
    model2 = small_model(1)
    opt2 = LocalAdam(model2.parameters(), -1)
    ckpt.load(shared_tmp_path / "p", model=model2, optimizer=opt2, comm=comm)
    assert_all(torch.equal(opt2.local, torch.full((3,), float(rank))) and opt2.seen == [3 * r for r in range(size)],
               f"{opt2.local} {opt2.seen}")
    assert_all(same(opt2.state_dict(), saved))


@pytest.mark.mpi(min_size=1)
def test_zero_refuses_optimizer_state_it_cannot_store(comm, shared_tmp_path):
    model = small_model(0)
    opt = ZeroOptimizer(Custom, model.parameters(), stage=1, comm=comm)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(ckpt.IncompatibleStateError, match=r"\['calls', 'history'\] beside 'state'"):
        ckpt.save(shared_tmp_path / "z", model=model, optimizer=opt, comm=comm)


class Counter:
    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self):
        return {"n": self.n, "t": torch.full((2,), float(self.n))}

    def load_state_dict(self, sd) -> None:
        self.n = sd["n"]
        assert torch.equal(sd["t"], torch.full((2,), float(self.n)))


class AllRanks:
    """The per-rank protocol: at load, receives every saved rank's state."""

    def __init__(self, value: int) -> None:
        self.value = value
        self.received = None

    def per_rank_state_dict(self):
        return {"v": self.value, "t": torch.tensor([self.value] * (self.value + 1))}

    def load_per_rank_state_dict(self, saved, rank, size) -> None:
        self.received = saved
        self.value = sum(s["v"] for s in saved)


@pytest.mark.mpi(min_size=1)
def test_items_of_every_kind_round_trip(comm, world, shared_tmp_path, capsys):
    rank = world.Get_rank()
    scheduler_model = small_model(0)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(scheduler_model.parameters(), lr=1.0), 2, 0.5)
    for _ in range(3):
        sched.optimizer.step()
        sched.step()
    weights = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    data = {"epoch": 3, "names": ["a", "b"], "t": torch.tensor([1, 2], dtype=torch.int32), "inner": Counter(4)}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 9, growth_interval=7)
    state = {"sched": sched, "w": weights, "data": data, "plain": 7, "mine": ckpt.PerRank(Counter(rank + 10)),
             "all": AllRanks(rank), "rng": ckpt.RNG(), "scaler": scaler}
    random.seed(1 + rank)
    np.random.seed(2 + rank)
    torch.manual_seed(3 + rank)
    ckpt.save(shared_tmp_path / "s", model=small_model(0), comm=comm, state=state)
    want_draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    saved_sched, saved_scaler = sched.state_dict(), scaler.state_dict()

    sched2 = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(small_model(0).parameters(), lr=1.0), 5, 0.1)
    w2 = torch.zeros(2, 3, dtype=torch.float64)
    data2 = {"epoch": 0, "names": [], "t": torch.zeros(2, dtype=torch.int32), "inner": Counter()}
    mine2, all2 = Counter(), AllRanks(-1)
    scaler2 = torch.amp.GradScaler("cpu")
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    info = ckpt.load(shared_tmp_path / "s", model=small_model(5), comm=comm,
                     state={"sched": sched2, "w": w2, "data": data2, "plain": None, "mine": ckpt.PerRank(mine2),
                            "all": all2, "rng": ckpt.RNG(), "scaler": scaler2})
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    size = world.Get_size()
    assert_all(draws == want_draws, f"{draws} != {want_draws}")
    assert_all(same(sched2.state_dict(), saved_sched) and same(scaler2.state_dict(), saved_scaler),
               f"{scaler2.state_dict()} != {saved_scaler}")
    assert_all(torch.equal(w2, weights) and data2["epoch"] == 3 and data2["names"] == ["a", "b"]
               and torch.equal(data2["t"], data["t"]) and data2["inner"].n == 4, str(data2))
    assert_all(info.state["plain"] == 7 and info.state["w"] is w2)
    assert_all(mine2.n == rank + 10, str(mine2.n))
    assert_all(all2.value == sum(range(size)) and [int(s["v"]) for s in all2.received] == list(range(size))
               and all(torch.equal(s["t"], torch.tensor([r] * (r + 1))) for r, s in enumerate(all2.received)))

    with pytest.raises(ckpt.IncompatibleStateError, match=r"'nope' is not in the checkpoint .* holds \['all'"):
        ckpt.load(shared_tmp_path / "s", model=small_model(5), comm=comm, state={"nope": Counter()})
    with pytest.raises(ckpt.IncompatibleStateError, match="'mine' was saved per rank only"):
        ckpt.load(shared_tmp_path / "s", model=small_model(5), comm=comm, state={"mine": Counter()})
    if rank == 0:
        code = ckpt_cli.main(["inspect", str(shared_tmp_path / "s")])
        out = capsys.readouterr().out
        assert code == 0 and f"state item 'mine': per rank, saved by {size} rank(s)" in out \
            and "state item 'w': replicated (1 tensor(s))" in out, out


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_per_rank_rule_at_other_world_sizes(comm, world, shared_tmp_path):
    rank, size = world.Get_rank(), world.Get_size()
    sub = world.Split(0 if rank == 0 else MPI.UNDEFINED, rank)
    if rank == 0:  # saved by one rank
        ckpt.save(shared_tmp_path / "one", model=small_model(0), comm=sub,
                  state={"sampler": ckpt.PerRank(Counter(41)), "rng": ckpt.RNG()})
        sub.Free()
    world.Barrier()
    caught = None
    try:
        ckpt.load(shared_tmp_path / "one", model=small_model(0), comm=comm, state={"sampler": ckpt.PerRank(Counter())})
    except Exception as exc:  # noqa: BLE001
        caught = exc
    seen = world.allgather((type(caught).__name__, str(caught)))
    assert_all(len(set(seen)) == 1 and isinstance(caught, ckpt.IncompatibleStateError), str(seen))
    assert_all("state item 'sampler'" in str(caught) and f"saved by 1 rank(s) and is loaded at {size}" in str(caught),
               str(caught))
    # a rule of one's own: every rank takes saved rank 0
    c = Counter()
    ckpt.load(shared_tmp_path / "one", model=small_model(0), comm=comm,
              state={"sampler": ckpt.PerRank(c, reshard=lambda saved, r, n: saved[0])})
    assert_all(c.n == 41)
    # saved by every rank, loaded by one: rank 0 takes saved rank 0
    ckpt.save(shared_tmp_path / "all", model=small_model(0), comm=comm, state={"sampler": ckpt.PerRank(Counter(rank))})
    if rank == 0:
        c0 = Counter(-1)
        ckpt.load(shared_tmp_path / "all", model=small_model(0), comm=MPI.COMM_SELF,
                  state={"sampler": ckpt.PerRank(c0)})
        assert c0.n == 0
    world.Barrier()


@pytest.mark.mpi(min_size=2)
def test_replicated_item_that_differs_between_ranks_is_refused(comm, world, shared_tmp_path):
    with pytest.raises(ckpt.IncompatibleStateError, match=r"'c' differs between ranks .*ckpt.PerRank"):
        ckpt.save(shared_tmp_path / "d", model=small_model(0), comm=comm, state={"c": Counter(world.Get_rank())})
    assert_all(not (shared_tmp_path / "d").exists())


# -- resume in fresh processes ----------------------------------------------------------------


def _job(*args: str, n: int) -> dict:
    env = clean_env()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [*mpiexec_cmd(n), sys.executable, "-m", "mpi4py", os.path.join(ROOT, "tests", "ckpt_resume_job.py"), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, f"{out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.split("LOSSES ", 1)[1])


@single_process
@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_resume_in_fresh_processes_is_bit_identical(tmp_path, n):
    k, total = 3, 7
    ran = _job("run", str(tmp_path), str(k), str(total), n=n)
    resumed = _job("resume", str(tmp_path), str(k), str(total), n=n)
    for kind, losses in ran.items():
        assert resumed[kind][k:] == losses[k:], f"{kind} at {n} ranks: {resumed[kind][k:]} != {losses[k:]}"
        assert len(set(losses)) == len(losses), f"{kind}: losses repeat, the test would not see a wrong resume"


# -- the previous format version ----------------------------------------------------------------


def _stored_v1(path: str) -> dict:
    """The tensors of a version-1 checkpoint read straight from its bytes (numpy at the offsets
    its manifest lists): the values stored with the fixture, independent of ckpt's reader."""
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(path, "data.bin"), "rb") as f:
        data = f.read()
    return {(t["name"], t["key"] or "param"): np.frombuffer(
                data, dtype=t["dtype"], count=math.prod(t["shape"]), offset=t["offset"]).reshape(t["shape"])
            for t in manifest["tensors"]}


def close(a, b) -> bool:
    """Like ``same``, float tensors within rounding (rtol 1e-5, atol 1e-6): for math recomputed on
    another CPU, which may round differently."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_floating_point():
        return a.dtype == b.dtype and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return same(a, b)


@single_process
def test_format_version_1_checkpoint_still_loads():
    path = os.path.join(ROOT, "tests", "data", "ckpt_v1")  # written by the version-1 code
    with open(os.path.join(path, "manifest.json")) as f:
        assert json.load(f)["version"] == 1
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    info = ckpt.load(path, model=model, optimizer=opt, comm=MPI.COMM_SELF)
    assert info.step == 2 and info.extra == {"epoch": 1} and info.manifest.state is None
    # bit for bit: what the fixture stores
    stored = _stored_v1(path)
    for i, (name, p) in enumerate(model.named_parameters()):
        got = {"param": p.detach(), **{k: opt.state[p][k] for k in ("exp_avg", "exp_avg_sq")}}
        for key, t in got.items():
            assert t.dtype == torch.float32 and np.array_equal(t.numpy().view(np.int32),
                                                               stored[name, key].view(np.int32)), (name, key)
        assert float(opt.state[p]["step"]) == 2.0
    # and it is the training it says it is: recomputed here, equal within rounding
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for _ in range(2):
        ref_opt.zero_grad()
        ref(torch.arange(6.).reshape(2, 3)).square().sum().backward()
        ref_opt.step()
    assert close(model.state_dict(), ref.state_dict()) and close(opt.state_dict(), ref_opt.state_dict())


class Broken:
    """state_dict() fails on one rank only."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def per_rank_state_dict(self):
        if self.fail:
            raise RuntimeError("sampler state unavailable (simulated)")
        return {"x": 1}

    def load_per_rank_state_dict(self, saved, rank, size) -> None:
        pass


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_item_failing_on_one_rank_raises_everywhere(comm, world, shared_tmp_path):
    last = world.Get_size() - 1
    caught = None
    try:
        ckpt.save(shared_tmp_path / "b", model=small_model(0), comm=comm,
                  state={"s": Broken(world.Get_rank() == last)})
    except Exception as exc:  # noqa: BLE001
        caught = exc
    assert_all(isinstance(caught, RuntimeError) and "simulated" in str(caught), repr(caught))
    if world.Get_size() > 1:
        seen = world.allgather(str(caught))
        assert_all(len(set(seen)) == 1 and f"save (planning) failed on rank {last} of" in seen[0], str(seen))
    assert_all(not (shared_tmp_path / "b").exists())
