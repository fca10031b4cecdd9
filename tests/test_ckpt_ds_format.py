"""DeepSpeed checkpoint import/export on checkpoints laid out here the way DeepSpeed 0.19 lays
them out (flat padded ZeRO partitions, pickled DeepSpeed objects), without DeepSpeed itself.

The expected values are the tensors the fake checkpoints were cut from."""
from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
import types
from collections import OrderedDict
from dataclasses import dataclass

import pytest
import torch
from mpitest import assert_all, check_all

import ckpt
from zero import ZeroOptimizer
from ckpt.deepspeed import (DeepSpeedFormatError, PickleRefusedError, from_deepspeed, read_deepspeed,
                            to_deepspeed_universal, write_universal)
from ckpt.deepspeed.pickles import Loader, Stub
from ckpt.deepspeed.reader import split_names

# ---------------------------------------------------------------------------------------------
# fake DeepSpeed files


class FakeLossScaler:
    _ds_global = ("deepspeed.runtime.fp16.loss_scaler", "LossScaler")

    def __init__(self) -> None:
        self.cur_scale = 1.0
        self.dynamic = False


class FakeStage:
    _ds_global = ("deepspeed.runtime.zero.config", "ZeroStageEnum")

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self):
        return (type(self), (self.value,))


@dataclass
class FakeFragment:
    numel: int
    start: int
    _ds_global = ("deepspeed.utils.tensor_fragment", "fragment_address")


class _DsPickler(pickle._Pickler):
    """Pickles the Fake* classes under DeepSpeed's own module paths, as DeepSpeed's files have them."""

    def save_global(self, obj, name=None):
        g = obj.__dict__.get("_ds_global") if isinstance(obj, type) else None
        if isinstance(obj, type) and issubclass(obj, Stub) and obj is not Stub:  # re-saving what we read
            g = (obj.__module__, obj.__qualname__)
        if g is None:
            return super().save_global(obj, name)
        self.write(pickle.GLOBAL + f"{g[0]}\n{g[1]}\n".encode())
        self.memoize(obj)


_DS_PICKLE = types.SimpleNamespace(Pickler=_DsPickler, __name__="pickle")


def _ds_save(obj, path):
    torch.save(obj, path, pickle_module=_DS_PICKLE)


SHAPES = OrderedDict([("enc.weight", (5, 7)), ("enc.bias", (5,)), ("dec.weight", (3, 5)),
                      ("dec.bias", (3,)), ("head.w", (11,))])
GROUPS = [["enc.weight", "enc.bias"], ["dec.weight", "dec.bias", "head.w"]]
HYPER = [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False},
         {"lr": 0.002, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1, "amsgrad": False}]
STEP = 5


def truth(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {n: {"fp32": torch.randn(s, generator=g), "exp_avg": torch.randn(s, generator=g),
                "exp_avg_sq": torch.rand(s, generator=g)} for n, s in SHAPES.items()}


def _model_states(dtype, world, stage, weights: bool, t):
    module = OrderedDict()
    module["norm.running"] = torch.arange(4.0)
    for n in SHAPES:
        module[n] = t[n]["fp32"].to(dtype) if weights else torch.empty(0, dtype=dtype)
    return {"module": module, "buffer_names": ["norm.running"],
            "param_shapes": [OrderedDict((n, torch.Size(SHAPES[n])) for n in g) for g in GROUPS],
            "dp_world_size": world, "mp_world_size": 1, "global_steps": STEP, "skipped_steps": 0,
            "ds_version": "0.19.8",
            "ds_config": {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}},
                          "zero_optimization": {"stage": stage}}}


def _groups():
    return [{**h, "params": [gi]} for gi, h in enumerate(HYPER)]


def make_zero12(folder: str, t, world: int, dtype=torch.float32) -> None:
    """ZeRO-1/2: each group flattened, padded to a multiple of ``world``, cut evenly; the last
    rank's fp32 partition is saved without the padding, as DeepSpeed does."""
    os.makedirs(folder, exist_ok=True)
    flats = {k: [torch.cat([t[n][k].reshape(-1) for n in g]) for g in GROUPS] for k in next(iter(t.values()))}
    per_rank = []
    for r in range(world):
        fp32, states, maps = [], {}, []
        for gi, g in enumerate(GROUPS):
            total = flats["fp32"][gi].numel()
            part = math.ceil(total / world)
            lo, hi = r * part, (r + 1) * part
            cut = {k: torch.nn.functional.pad(v[gi], (0, part * world - total))[lo:hi].clone()
                   for k, v in flats.items()}
            fp32.append(cut["fp32"][:max(0, min(part, total - lo))].clone())
            states[gi] = {"step": torch.tensor(float(STEP)), "exp_avg": cut["exp_avg"],
                          "exp_avg_sq": cut["exp_avg_sq"]}
            m, off = OrderedDict(), 0
            for n in g:
                k = math.prod(SHAPES[n])
                a, b = max(off, lo), min(off + k, hi)
                if a < b:
                    m[n] = FakeFragment(numel=b - a, start=a - lo)
                off += k
            maps.append(m)
        per_rank.append({"optimizer_state_dict": {
            "loss_scaler": FakeLossScaler(), "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
            "base_optimizer_state": {"state": states, "param_groups": _groups()},
            "single_partition_of_fp32_groups": fp32, "zero_stage": FakeStage(1),
            "partition_count": [world] * len(GROUPS), "ds_version": "0.19.8", "param_slice_mappings": maps}})
    prefix = "bf16_" if dtype == torch.bfloat16 else ""
    for r, sd in enumerate(per_rank):
        _ds_save(sd, os.path.join(folder, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
    torch.save(_model_states(dtype, world, 1, True, t), os.path.join(folder, "mp_rank_00_model_states.pt"))


def make_zero3(folder: str, t, world: int, dtype=torch.float32) -> None:
    """ZeRO-3: every parameter cut alone into ceil(numel / world) pieces, each rank's pieces
    (padded) one after another in one flat tensor per group."""
    os.makedirs(folder, exist_ok=True)
    for r in range(world):
        flat, states = [], {}
        for gi, g in enumerate(GROUPS):
            cut = {}
            for k in ("fp32", "exp_avg", "exp_avg_sq"):
                pieces = []
                for n in g:
                    v = t[n][k].reshape(-1)
                    piece = math.ceil(v.numel() / world)
                    pieces.append(torch.nn.functional.pad(v, (0, piece * world - v.numel()))[r * piece:(r + 1) * piece])
                cut[k] = torch.cat(pieces).clone()
            flat.append(cut["fp32"])
            states[gi] = {"step": torch.tensor(float(STEP)), "exp_avg": cut["exp_avg"],
                          "exp_avg_sq": cut["exp_avg_sq"]}
        prefix = "bf16_" if dtype == torch.bfloat16 else ""
        _ds_save({"optimizer_state_dict": {
            "zero_stage": FakeStage(3), "loss_scaler": FakeLossScaler(), "dynamic_loss_scale": False,
            "overflow": False, "partition_count": world,
            "optimizer_state_dict": {"state": states, "param_groups": _groups()}, "fp32_flat_groups": flat}},
            os.path.join(folder, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        torch.save(_model_states(dtype, world, 3, False, t),
                   os.path.join(folder, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))


def make(folder: str, stage: int, world: int, dtype=torch.float32, seed: int = 0):
    t = truth(seed)
    (make_zero3 if stage == 3 else make_zero12)(folder, t, world, dtype)
    return t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# reader


@pytest.mark.parametrize("stage,world,dtype", [(1, 1, torch.float32), (1, 3, torch.float32),
                                               (2, 4, torch.bfloat16), (3, 3, torch.float32),
                                               (3, 4, torch.bfloat16)])
def test_reader_unflattens_partitions(tmp_path, stage, world, dtype):
    t = make(str(tmp_path), stage, world, dtype)
    st = read_deepspeed(tmp_path)
    assert st.stage == (3 if stage == 3 else 1) and st.world_size == world and st.dtype == dtype
    assert st.names == [n for g in GROUPS for n in g]
    assert st.group == {n: gi for gi, g in enumerate(GROUPS) for n in g}
    assert st.param_groups == HYPER
    assert (st.step, st.step_dtype) == (STEP, torch.float32)
    assert st.optimizer_class == "torch.optim.Adam"
    assert st.buffer_names == ["norm.running"] and _same(st.model_state["norm.running"], torch.arange(4.0))
    for n in SHAPES:
        for k in ("fp32", "exp_avg", "exp_avg_sq"):
            assert _same(st.tensors[n][k], t[n][k]), (n, k)
        assert _same(st.weight(n), t[n]["fp32"].to(dtype)), n


def test_reader_does_not_import_deepspeed(tmp_path):
    make(str(tmp_path), 3, 2)
    code = ("import sys; from ckpt.deepspeed import read_deepspeed; "
            f"s = read_deepspeed({str(tmp_path)!r}); "
            "print(s.stage, 'deepspeed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["3", "False"]


def test_reader_names_and_rank_shares(tmp_path):
    t = make(str(tmp_path), 1, 3)
    only = read_deepspeed(tmp_path, names=["head.w"])
    assert list(only.tensors) == ["head.w"] and _same(only.tensors["head.w"]["exp_avg"], t["head.w"]["exp_avg"])
    seen = []
    for rank in range(3):
        part = read_deepspeed(tmp_path, comm=types.SimpleNamespace(rank=rank, size=3))
        assert list(part.tensors) == part.owned
        seen += part.owned
        for n in part.owned:
            assert _same(part.tensors[n]["fp32"], t[n]["fp32"])
    assert seen == list(read_deepspeed(tmp_path, names=[]).names)
    with pytest.raises(KeyError, match="nope"):
        read_deepspeed(tmp_path, names=["nope"])


@pytest.mark.parametrize("numels,parts", [([5, 5, 5, 5], 2), ([100, 1, 1, 1], 3), ([1, 2, 3], 5), ([], 2),
                                          ([0, 0, 7], 2)])
def test_split_names_is_an_ordered_balanced_cover(numels, parts):
    names = [f"p{i}" for i in range(len(numels))]
    out = split_names(names, numels, parts)
    assert len(out) == parts and [n for p in out for n in p] == names
    size = dict(zip(names, numels))
    if numels:
        for p in out:
            assert sum(size[n] for n in p) <= sum(numels) / parts + max(numels)


def test_reader_format_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_deepspeed(tmp_path / "missing")
    make(str(tmp_path / "a"), 1, 3)
    os.remove(tmp_path / "a" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(DeepSpeedFormatError, match=r"ranks 0\.\.1, found ranks \[0, 2\]"):
        read_deepspeed(tmp_path / "a")
    make(str(tmp_path / "b"), 1, 2)
    os.rename(tmp_path / "b" / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
              tmp_path / "b" / "zero_pp_rank_0_mp_rank_01_optim_states.pt")
    with pytest.raises(DeepSpeedFormatError, match="mp_rank > 0"):
        read_deepspeed(tmp_path / "b")
    os.makedirs(tmp_path / "c")
    torch.save({}, tmp_path / "c" / "mp_rank_00_model_states.pt")
    with pytest.raises(DeepSpeedFormatError, match="no ZeRO optimizer files"):
        read_deepspeed(tmp_path / "c")


# ---------------------------------------------------------------------------------------------
# universal layout


def test_write_universal_layout(tmp_path):
    t = make(str(tmp_path / "ds"), 3, 2, torch.bfloat16)
    out = write_universal(read_deepspeed(tmp_path / "ds"), tmp_path / "root" / "tag")
    assert (tmp_path / "root" / "latest_universal").read_text() == "tag"
    for n in SHAPES:
        for k in ("fp32", "exp_avg", "exp_avg_sq"):
            d = torch.load(os.path.join(out, "zero", n, f"{k}.pt"), weights_only=True)
            assert d["cat_dim"] == 0 and _same(d["param"], t[n][k]), (n, k)
        assert _same(torch.load(os.path.join(out, "zero", n, "step.pt"), weights_only=True),
                     torch.tensor(float(STEP)))
    assert _same(torch.load(os.path.join(out, "zero", "norm.running", "fp32.pt"))["param"], torch.arange(4.0))
    osd = torch.load(os.path.join(out, "zero", "optimizer_state.pt"), weights_only=True)
    assert [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]] == HYPER
    assert osd["ds_version"] == "0.19.8" and _same(osd["optimizer_state_dict"]["state"][0]["step"],
                                                   torch.tensor(float(STEP)))
    for f in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        ms = torch.load(os.path.join(out, f), weights_only=True)
        assert ms["dp_world_size"] == 2 and ms["global_steps"] == STEP
        assert [dict(g) for g in ms["param_shapes"]] == [{n: torch.Size(SHAPES[n]) for n in g} for g in GROUPS]


# ---------------------------------------------------------------------------------------------
# through our format, at any number of ranks


class Net(torch.nn.Module):
    def __init__(self, dtype) -> None:
        super().__init__()
        self.enc = torch.nn.Linear(7, 5).to(dtype)
        self.dec = torch.nn.Linear(5, 3).to(dtype)
        self.head = torch.nn.Module()
        self.head.w = torch.nn.Parameter(torch.zeros(11, dtype=dtype))
        self.norm = torch.nn.Module()
        self.norm.register_buffer("running", torch.zeros(4))


def _net_groups(net):
    p = dict(net.named_parameters())
    return [{"params": [p[n] for n in g], **h} for g, h in zip(GROUPS, HYPER)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("stage,ds_world,dtype", [(1, 3, torch.float32), (3, 2, torch.bfloat16)])
def test_from_deepspeed_loads_into_plain_and_zero_optimizers(comm, world, shared_tmp_path, stage, ds_world,
                                                             dtype):
    src, ours = str(shared_tmp_path / "ds"), str(shared_tmp_path / "ours")
    if world.Get_rank() == 0:
        make(src, stage, ds_world, dtype)
    world.Barrier()
    t = truth()
    m = from_deepspeed(src, ours, comm=comm)
    assert m.stage == (2 if stage == 3 else 1) and m.world_size == comm.size and m.step == STEP

    # a plain optimizer gets the full state on every rank
    net = Net(dtype)
    opt = torch.optim.Adam(_net_groups(net))
    res = ckpt.load(ours, model=net, optimizer=opt, comm=comm)

    def check_plain():
        assert res.optimizer_loaded and res.extra["imported_from"] == "deepspeed"
        named = dict(net.named_parameters())
        for n in SHAPES:
            assert _same(named[n].detach(), t[n]["fp32"].to(dtype)), n
            s = opt.state[named[n]]
            for k in ("exp_avg", "exp_avg_sq"):  # torch casts a plain optimizer's state to the param dtype
                assert _same(s[k], t[n][k].to(dtype)), (n, k)
            assert float(s["step"]) == STEP
        assert _same(net.norm.running, torch.arange(4.0))
        for g, h in zip(opt.param_groups, HYPER):
            assert {k: g[k] for k in h} == h
    check_all(check_plain)

    # a ZeroOptimizer gets the fp32 masters (exact even when the model is bf16)
    net2 = Net(dtype)
    zero = ZeroOptimizer(torch.optim.Adam, _net_groups(net2), stage=1, comm=comm)
    ckpt.load(ours, model=net2, optimizer=zero, comm=comm)

    def check_zero():
        for gi, (g, names) in enumerate(zip(zero.groups, GROUPS)):
            st = zero.shard_state(gi)
            for s in g.layout.segments(comm.rank):
                full = t[names[s.param]]
                want = full["fp32"].reshape(-1)[s.start:s.start + s.length]
                assert torch.equal(g.master[s.local:s.local + s.length], want)
                want = full["exp_avg_sq"].reshape(-1)[s.start:s.start + s.length]
                assert torch.equal(st["exp_avg_sq"][s.local:s.local + s.length], want)
    check_all(check_zero)

    # export: the same files as writing the DeepSpeed checkpoint's description directly
    out = str(shared_tmp_path / "uni" / "tag")
    to_deepspeed_universal(ours, out, comm=comm)
    world.Barrier()
    ok, msg = True, ""
    if world.Get_rank() == 0:
        for n in SHAPES:
            for k in ("fp32", "exp_avg", "exp_avg_sq"):
                got = torch.load(os.path.join(out, "zero", n, f"{k}.pt"), weights_only=True)["param"]
                if not _same(got, t[n][k]):
                    ok, msg = False, f"{n} {k} differs"
            step = torch.load(os.path.join(out, "zero", n, "step.pt"), weights_only=True)
            if not _same(step, torch.tensor(float(STEP))):
                ok, msg = False, f"{n} step is {step!r}"
    assert_all(ok, msg)


def test_from_deepspeed_follows_latest_and_rejects_non_adam_state(comm, world, tmp_path):
    if world.Get_size() > 1:
        pytest.skip("single-process test")
    make(str(tmp_path / "root" / "step5"), 1, 2)
    (tmp_path / "root" / "latest").write_text("step5")
    m = from_deepspeed(tmp_path / "root", tmp_path / "ours", comm=comm)
    assert m.step == STEP and m.extra["source"].endswith("step5") and m.extra["ds_world_size"] == 2

    make(str(tmp_path / "sgd"), 1, 2)
    path = tmp_path / "sgd" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    sd = Loader().load(str(path))
    for st in sd["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
        st["momentum_buffer"] = st.pop("exp_avg").clone()
    _ds_save(sd, str(path) + ".new")
    os.replace(str(path) + ".new", path)
    with pytest.raises(DeepSpeedFormatError, match=r"Adam-style optimizer state .* found \['exp_avg_sq', "
                                                    r"'momentum_buffer', 'step'\]"):
        read_deepspeed(tmp_path / "sgd")


def test_to_deepspeed_universal_from_a_plain_torch_checkpoint(comm, world, tmp_path):
    """Our own checkpoint (not imported) exports too: weights, Adam state and step per parameter."""
    if world.Get_size() > 1:
        pytest.skip("single-process test")
    torch.manual_seed(3)
    net = Net(torch.float32)
    opt = torch.optim.AdamW(_net_groups(net))
    for _ in range(2):
        opt.zero_grad()
        (net.dec(torch.tanh(net.enc(torch.randn(4, 7)))).square().sum() + net.head.w.square().sum()).backward()
        opt.step()
    ckpt.save(tmp_path / "ours", model=net, optimizer=opt, step=2, comm=comm)
    out = to_deepspeed_universal(tmp_path / "ours", tmp_path / "uni" / "tag")
    named = dict(net.named_parameters())
    for n in SHAPES:
        d = {k: torch.load(os.path.join(out, "zero", n, f"{k}.pt"), weights_only=True)["param"]
             for k in ("fp32", "exp_avg", "exp_avg_sq")}
        assert _same(d["fp32"], named[n].detach())
        for k in ("exp_avg", "exp_avg_sq"):
            assert _same(d[k], opt.state[named[n]][k]), (n, k)
        assert _same(torch.load(os.path.join(out, "zero", n, "step.pt"), weights_only=True),
                     opt.state[named[n]]["step"])
    osd = torch.load(os.path.join(out, "zero", "optimizer_state.pt"), weights_only=True)
    assert [g["lr"] for g in osd["param_groups"]] == [h["lr"] for h in HYPER]
    ms = torch.load(os.path.join(out, "mp_rank_00_model_states.pt"), weights_only=True)
    assert _same(ms["module"]["norm.running"], torch.zeros(4)) and ms["dp_world_size"] == 1

    bare = tmp_path / "bare"
    ckpt.save(bare, model=net, comm=comm)
    with pytest.raises(ValueError, match="no optimizer state"):
        to_deepspeed_universal(bare, tmp_path / "uni2" / "tag")
