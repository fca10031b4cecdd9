"""data.bin is a safetensors file: the safetensors library (the independent reader) returns the
model's state under its state_dict names and the optimizer's under documented prefixes; the
model-only export; checkpoints of format versions 1 and 2 (no header) still load."""
from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from mpi4py import MPI
from mpitest import check_all
from safetensors import safe_open
from safetensors.torch import load_file

import ckpt
from zero import ZeroOptimizer
from ckpt import cli as ckpt_cli
from ckpt.export import export_safetensors
from ckpt.manifest import FORMAT_VERSION, Manifest

HERE = os.path.dirname(os.path.abspath(__file__))
OLD = {1: os.path.join(HERE, "data", "ckpt_v1_adam"), 2: os.path.join(HERE, "data", "ckpt_v2")}


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.enc = torch.nn.Linear(6, 5).to(dtype)
        self.norm = torch.nn.BatchNorm1d(5).to(dtype)
        self.dec = torch.nn.Linear(5, 3).to(dtype)
        self.empty = torch.nn.Parameter(torch.zeros(0, 4, dtype=dtype))

    def forward(self, x):
        return self.dec(torch.tanh(self.norm(self.enc(x)))).float().square().mean() + self.empty.sum()


def trained(dtype, opt_kind, comm, stage=1, steps=2):
    net = Net(dtype)
    if opt_kind == "zero":
        opt = ZeroOptimizer(torch.optim.AdamW, net.parameters(), stage=stage, comm=comm, lr=0.01)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        opt.zero_grad()
        net(torch.randn(4, 6, generator=g).to(dtype)).backward()
        opt.step()
    return net, opt


def check_header_bytes(path: str) -> dict:
    """The layout rules the safetensors format sets, checked byte by byte."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and raw[8:9] == b"{", n
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__")
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    pos = 0
    for a, b in spans:
        assert a == pos, (a, pos)
        pos = b
    assert 8 + n + pos == len(raw), "tensors must fill the file to its end without gaps"
    return header


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("opt_kind,stage", [("plain", None), ("zero", 1), ("zero", 2)])
def test_data_bin_reads_with_safetensors(comm, world, shared_tmp_path, dtype, opt_kind, stage):
    net, opt = trained(dtype, opt_kind, comm, stage or 1)
    m = ckpt.save(shared_tmp_path / "ck", model=net, optimizer=opt, step=2, comm=comm)
    path = str(shared_tmp_path / "ck" / "data.bin")

    def check():
        assert m.version == FORMAT_VERSION == 4
        header = check_header_bytes(path)
        got = load_file(path)
        assert set(got) == set(header)
        for name, t in net.state_dict().items():  # every model tensor under its state_dict name
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        names = dict((id(p), n) for n, p in net.named_parameters())
        if opt_kind == "plain":
            for p, st in opt.state.items():
                for k in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(got[f"optimizer/state/{names[id(p)]}/{k}"], st[k]), (names[id(p)], k)
            assert not any(k.startswith("optimizer/master/") for k in got)
        else:  # this rank's shard equals the same elements of the full tensors in the file
            for gi, g in enumerate(opt.groups):
                st = opt.shard_state(gi)
                pnames = [names[id(p)] for p in g.params]
                for s in g.layout.segments(comm.rank):
                    n = pnames[s.param]
                    flat = (got[n] if dtype == torch.float32 else got[f"optimizer/master/{n}"]).reshape(-1)
                    assert torch.equal(flat[s.start:s.start + s.length], g.master[s.local:s.local + s.length]), n
                    for k in ("exp_avg", "exp_avg_sq"):
                        ref = st[k][s.local:s.local + s.length]
                        assert torch.equal(got[f"optimizer/state/{n}/{k}"].reshape(-1)[s.start:s.start + s.length],
                                           ref), (n, k)
            if dtype == torch.float32:  # the masters are the model weights: stored once
                assert not any(k.startswith("optimizer/master/") for k in got)
        with safe_open(path, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    check_all(check)


@pytest.mark.mpi(min_size=1)
def test_export_model_only(comm, world, shared_tmp_path, capsys):
    net, opt = trained(torch.bfloat16, "zero", comm, 2)
    ckpt.save(shared_tmp_path / "run" / "step2", model=net, optimizer=opt, step=2, comm=comm)
    world.Barrier()
    if world.Get_rank() == 0:
        out = str(shared_tmp_path / "m" / "model.safetensors")
        export_safetensors(shared_tmp_path / "run", out)  # follows latest
        check_header_bytes(out)
        got = load_file(out)
        sd = net.state_dict()
        assert set(got) == set(sd)
        for name, t in sd.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        # a flipped byte in a model tensor fails the export, naming the tensor
        d = shared_tmp_path / "run" / "step2"
        m = ckpt.read_manifest(d)
        e = m.find("param", m.param_index()["dec.weight"])
        with open(d / "data.bin", "r+b") as f:
            f.seek(e.offset + 3)
            b = f.read(1)
            f.seek(e.offset + 3)
            f.write(bytes([b[0] ^ 0x10]))
        with pytest.raises(ckpt.ChecksumError, match="dec.weight"):
            export_safetensors(d, str(shared_tmp_path / "m" / "bad.safetensors"))
        assert not os.path.exists(shared_tmp_path / "m" / "bad.safetensors")
    world.Barrier()


def test_export_cli(comm, world, tmp_path, capsys):
    if world.Get_size() > 1:
        pytest.skip("single-process test (the CLI runs on the world)")
    net, opt = trained(torch.float32, "plain", comm)
    ckpt.save(tmp_path / "ck", model=net, optimizer=opt, step=2, comm=comm)
    out = tmp_path / "model.safetensors"
    code = ckpt_cli.main(["export", "--to", "safetensors", str(tmp_path / "ck"), str(out)])
    assert code == 0, capsys.readouterr().err
    got = load_file(str(out))
    assert set(got) == set(net.state_dict())
    for name, t in net.state_dict().items():
        assert torch.equal(got[name], t), name
    code = ckpt_cli.main(["export", "--to", "safetensors", str(tmp_path / "ck"), str(out)])
    assert code == ckpt_cli.EXIT_EXISTS, "an existing file is kept without --overwrite"


def old_values():
    """What tests/data/ckpt_v1_adam and ckpt_v2 hold (format versions 1 and 2, written by the code
    of those versions, before data.bin had a header): a Linear(4, 3), a bf16 parameter ``low``
    and an int64 buffer ``count``, set to these values, with Adam state set by hand, saved at
    step 3 by one rank; version 2 also has the state item ``table``."""
    params = {"low": torch.arange(5.0).to(torch.bfloat16) / 4,
              "lin.weight": torch.arange(12.0).reshape(3, 4) / 8,
              "lin.bias": torch.tensor([-1.5, 0.25, 3.0])}
    state = {n: {"exp_avg": torch.full_like(t, 0.5 + i), "exp_avg_sq": torch.full_like(t, 0.125 * (i + 1))}
             for i, (n, t) in enumerate(params.items())}
    return params, torch.tensor([7, 9]), state


class OldNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.low = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
        self.register_buffer("count", torch.zeros(2, dtype=torch.int64))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("version", [1, 2])
def test_previous_format_versions_still_load(comm, world, version):
    raw = json.load(open(os.path.join(OLD[version], "manifest.json")))
    assert raw["version"] == version
    assert min(t["offset"] for t in raw["tensors"]) == 0, "before version 3 the tensors start at byte 0"
    params, count, state = old_values()
    net = OldNet()
    opt = torch.optim.Adam(net.parameters(), lr=0.5)
    table = {"w": torch.zeros(2, 3, dtype=torch.int32), "k": 0}
    res = ckpt.load(OLD[version], model=net, optimizer=opt, comm=comm, state={"table": table} if version > 1 else None)

    def check():
        assert res.step == 3 and res.extra == {"note": f"format v{version}"} and res.manifest.version == version
        named = dict(net.named_parameters())
        for n, t in params.items():
            assert named[n].dtype == t.dtype and torch.equal(named[n].detach(), t), n
        assert torch.equal(net.count, count)
        for n, st in state.items():
            for k, v in st.items():
                assert torch.equal(opt.state[named[n]][k], v), (n, k)
            assert float(opt.state[named[n]]["step"]) == 3.0
        assert opt.param_groups[0]["lr"] == 0.01  # the saved hyperparameters
        if version > 1:
            assert torch.equal(table["w"], torch.arange(6, dtype=torch.int32).reshape(2, 3))
            assert res.state["table"]["k"] == 4
    check_all(check)


def test_newer_version_is_refused(tmp_path):
    shutil.copytree(OLD[2], tmp_path / "ck")
    raw = json.load(open(tmp_path / "ck" / "manifest.json"))
    raw["version"] = FORMAT_VERSION + 1
    (tmp_path / "ck" / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ckpt.ManifestError, match="newer"):
        ckpt.read_manifest(tmp_path / "ck")
    assert Manifest.from_json(open(os.path.join(OLD[1], "manifest.json")).read()).version == 1


@pytest.mark.mpi(min_size=1)
def test_state_items_are_named_by_their_keys(comm, world, shared_tmp_path):
    net = Net()
    table = {"w": torch.arange(6, dtype=torch.int32).reshape(2, 3), "k": 4}
    ckpt.save(shared_tmp_path / "ck", model=net, comm=comm, state={"table": table, "rng": ckpt.RNG()})

    def check():
        got = load_file(str(shared_tmp_path / "ck" / "data.bin"))
        assert torch.equal(got["items/table/0"], table["w"])
        ranks = {k.split("@")[1].split("/")[0] for k in got if k.startswith("items/rng@")}
        assert ranks == {str(r) for r in range(comm.size)}, sorted(got)
    check_all(check)
