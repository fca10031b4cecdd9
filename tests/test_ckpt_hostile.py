"""ckpt given files it did not write as it wrote them: flipped bytes, truncated, missing and
garbled files, a checkpoint of another model, and pickles planted anywhere (never unpickled)."""
from __future__ import annotations

import os
import pickle

import pytest
import torch
from mpi4py import MPI

import ckpt
from ckpt import cli as ckpt_cli
from ckpt_small import cli, make_model, same_state, save_small, self_comm
from conftest import single_process
from zero import ZeroOptimizer


# ---------------------------------------------------------------------------------------------
# damaged files


@single_process
def test_flipped_byte_names_tensor_and_block(tmp_path, capsys):
    model, m = save_small(tmp_path / "c", block_size=64, chunk_bytes=64)
    victim = m.find("state", m.param_index()["2.weight"], "exp_avg")
    block = (victim.offset + 5) // 64
    with open(tmp_path / "c" / "data.bin", "r+b") as f:
        f.seek(victim.offset + 5)
        b = f.read(1)
        f.seek(victim.offset + 5)
        f.write(bytes([b[0] ^ 0x01]))
    code, out, err = cli("verify", str(tmp_path / "c"), capsys=capsys)
    assert code == ckpt_cli.EXIT_DAMAGED and f"BAD: 1 of {len(m.files['data.bin']['crc32'])} blocks" in out
    assert f"block {block} " in out and "'2.weight' state exp_avg" in out, out
    other = make_model(3)
    opt = ZeroOptimizer(torch.optim.Adam, other.parameters(), stage=2, comm=self_comm(), lr=0.01)
    with pytest.raises(ckpt.ChecksumError, match=rf"checksum mismatch .*block {block} .*'2.weight' state exp_avg"):
        ckpt.load(tmp_path / "c", model=other, optimizer=opt, comm=MPI.COMM_SELF)


@single_process
def test_damaged_files_give_clear_errors(tmp_path, capsys):
    cases = {}
    for name in ("truncated", "missing", "newer", "garbled", "not-json-object", "no-latest-target"):
        save_small(tmp_path / name / "ck")
    d = tmp_path / "truncated" / "ck"
    with open(d / "data.bin", "r+b") as f:
        f.truncate(100)
    cases["truncated"] = (ckpt.DamagedCheckpointError, r"expected \d+ bytes, found 100 \(truncated\)",
                          ckpt_cli.EXIT_DAMAGED)
    os.unlink(tmp_path / "missing" / "ck" / "data.bin")
    cases["missing"] = (ckpt.DamagedCheckpointError, "data.bin is missing", ckpt_cli.EXIT_DAMAGED)
    mp = tmp_path / "newer" / "ck" / "manifest.json"
    mp.write_text(mp.read_text().replace(f'"version": {ckpt.FORMAT_VERSION}', '"version": 99'))
    cases["newer"] = (ckpt.ManifestError, f"version {ckpt.FORMAT_VERSION}, got 99: .*newer ckpt; upgrade",
                      ckpt_cli.EXIT_USAGE)
    mp = tmp_path / "garbled" / "ck" / "manifest.json"
    mp.write_text(mp.read_text()[:-40])
    cases["garbled"] = (ckpt.ManifestError, "manifest.json: manifest is not valid JSON", ckpt_cli.EXIT_USAGE)
    (tmp_path / "not-json-object" / "ck" / "manifest.json").write_text("[1, 2]")
    cases["not-json-object"] = (ckpt.ManifestError, "expected format 'mpicomm-ckpt'", ckpt_cli.EXIT_USAGE)
    (tmp_path / "no-latest-target" / "latest").write_text("gone\n")
    cases["no-latest-target"] = (ckpt.ManifestError, "names 'gone', which has no manifest.json", ckpt_cli.EXIT_USAGE)

    for name, (exc, pattern, code) in cases.items():
        path = tmp_path / name if name == "no-latest-target" else tmp_path / name / "ck"
        with pytest.raises(exc, match=pattern):
            ckpt.load(path, model=make_model(), comm=MPI.COMM_SELF)
        for cmd in ("verify", "inspect"):
            got, out, err = cli(cmd, str(path), capsys=capsys)
            assert got == code and err.startswith(f"python -m ckpt {cmd}: "), (name, cmd, got, err)
            assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    got, _, err = cli("inspect", str(tmp_path / "nowhere"), capsys=capsys)
    assert got == ckpt_cli.EXIT_USAGE and "does not exist" in err


# ---------------------------------------------------------------------------------------------
# loading into another model


class Other(torch.nn.Module):
    """Like make_model's Sequential, but with '0.*' renamed, '2.weight' of another shape, and an extra."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 16)
        self.add_module("2", torch.nn.Linear(16, 3))
        self.extra = torch.nn.Parameter(torch.full((4,), 7.0))
        with torch.no_grad():
            getattr(self, "2").weight = torch.nn.Parameter(torch.zeros(3, 8))


@single_process
def test_load_into_a_different_model(tmp_path):
    saved, _ = save_small(tmp_path / "c")
    other = Other()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ckpt.StateMismatchError) as info:
        ckpt.load(tmp_path / "c", model=other, comm=MPI.COMM_SELF)
    msg = str(info.value)
    for needle in ("missing 3, unexpected 2, other shapes 1", "'first.weight'", "'first.bias'", "'extra'",
                   "'0.weight'", "'0.bias'", "'2.weight' expected shape (3, 8), checkpoint has (3, 16)",
                   "strict=False"):
        assert needle in msg, (needle, msg)
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items()), "a failed strict load wrote"

    res = ckpt.load(tmp_path / "c", model=other, comm=MPI.COMM_SELF, strict=False)
    assert res.missing == ["extra", "first.weight", "first.bias"]  # state_dict order
    assert res.unexpected == ["0.weight", "0.bias"]
    assert res.mismatched == {"2.weight": ((3, 8), (3, 16))}
    assert not res.complete
    sd = other.state_dict()
    assert torch.equal(sd["2.bias"], saved.state_dict()["2.bias"]), "the matching entry is loaded"
    for k in ("first.weight", "first.bias", "extra", "2.weight"):
        assert torch.equal(sd[k], before[k]), f"{k} must stay untouched"

    # an optimizer over mismatched parameters cannot be loaded in part: a clear error
    opt = torch.optim.Adam(other.parameters(), lr=0.01)
    with pytest.raises(ckpt.StateMismatchError, match="optimizer=None"):
        ckpt.load(tmp_path / "c", model=other, optimizer=opt, comm=MPI.COMM_SELF, strict=False)
    full = ckpt.load(tmp_path / "c", model=make_model(9), comm=MPI.COMM_SELF)
    assert full.complete and (full.missing, full.unexpected, full.mismatched) == ([], [], {})

    # strict=False with an extra buffer: the optimizer's parameters all match, so it loads too
    grown = make_model(9)
    grown.register_buffer("counter", torch.tensor([3]))
    opt = ZeroOptimizer(torch.optim.Adam, grown.parameters(), stage=2, comm=self_comm(), lr=0.5)
    res = ckpt.load(tmp_path / "c", model=grown, optimizer=opt, comm=MPI.COMM_SELF, strict=False)
    assert res.optimizer_loaded and res.missing == ["counter"] and not res.unexpected and not res.mismatched
    assert same_state(torch.nn.Sequential(*list(grown.children())), saved) and int(grown.counter) == 3
    assert opt.param_groups[0]["lr"] == 0.01


# ---------------------------------------------------------------------------------------------
# hostile files


class Bomb:
    """Unpickling this creates the file at ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@single_process
def test_pickle_bombs_are_never_unpickled(tmp_path, capsys):
    marker = str(tmp_path / "PWNED")
    bomb = pickle.dumps(Bomb(marker), protocol=2)
    bomb0 = pickle.dumps(Bomb(marker), protocol=0)  # ASCII: decodes as text, fails as JSON
    pickle.loads(pickle.dumps(Bomb(marker + ".selftest")))  # the bomb works
    assert os.path.exists(marker + ".selftest")

    # as the manifest, in both pickle flavours
    for i, payload in enumerate((bomb, bomb0)):
        d = tmp_path / f"as-manifest-{i}"
        save_small(d)
        (d / "manifest.json").write_bytes(payload)
        with pytest.raises(ckpt.ManifestError, match="manifest"):
            ckpt.load(d, model=make_model(), comm=MPI.COMM_SELF)
        for cmd in ("verify", "inspect"):
            assert cli(cmd, str(d), capsys=capsys)[0] == ckpt_cli.EXIT_USAGE
        with pytest.raises(ckpt.ManifestError):
            ckpt.Manifest.from_json(payload)
    # as the data file
    d = tmp_path / "as-data"
    save_small(d)
    (d / "data.bin").write_bytes(bomb)
    with pytest.raises(ckpt.DamagedCheckpointError):
        ckpt.load(d, model=make_model(), comm=MPI.COMM_SELF)
    assert cli("verify", str(d), capsys=capsys)[0] == ckpt_cli.EXIT_DAMAGED
    # as extra files in a good checkpoint and its parent: ignored
    root = tmp_path / "extras"
    saved, _ = save_small(root / "ck")
    for where in (root, root / "ck"):
        (where / "bomb.pkl").write_bytes(bomb)
        (where / "model.pt").write_bytes(bomb)
        torch.save({"x": Bomb(marker)}, where / "zipped.pt")
    model = make_model(4)
    ckpt.load(root, model=model, comm=MPI.COMM_SELF)
    assert same_state(model, saved)
    assert cli("verify", str(root), capsys=capsys)[0] == 0
    assert cli("inspect", str(root), "--tensors", capsys=capsys)[0] == 0
    # a DeepSpeed folder made of bombs, with and without allow_pickle
    ds = tmp_path / "ds"
    ds.mkdir()
    for f in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (ds / f).write_bytes(bomb)
    with pytest.raises(ckpt.PickleRefusedError, match="arbitrary code"):
        ckpt.from_deepspeed(ds, tmp_path / "imported", comm=self_comm())
    for f in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"x": Bomb(marker)}, ds / f)  # torch's zip format too
    with pytest.raises(ckpt.PickleRefusedError):
        ckpt.from_deepspeed(ds, tmp_path / "imported", comm=self_comm())
    with pytest.raises(ckpt.PickleRefusedError):
        ckpt.from_deepspeed(ds, tmp_path / "imported", comm=self_comm(), allow_pickle=True)
    for flag in ([], ["--allow-pickle"]):
        code, _, err = cli("convert", "--from", "deepspeed", str(ds), str(tmp_path / "imported"), *flag,
                           capsys=capsys)
        assert code == ckpt_cli.EXIT_PICKLE and "arbitrary code" in err, err
    assert not (tmp_path / "imported").exists()
    assert not os.path.exists(marker), "a pickle was executed"
