"""DeepSpeed import is safe without consent: hostile pickles never run, with or without the
flag, and a damaged zip entry is an error naming the file and the entry, on every rank."""
from __future__ import annotations

import builtins
import importlib.util
import os
import pickle
import shutil
import struct
import zipfile

import pytest
import torch
from mpitest import check_all
from test_ckpt_ds_format import SHAPES, _ds_save, _same, make, truth

import ckpt
from ckpt import cli as ckpt_cli
from ckpt.deepspeed import PickleRefusedError, from_deepspeed, read_deepspeed
from ckpt.deepspeed.pickles import DEEPSPEED_GLOBALS, ZipEntryError, check_zip

OPTIM0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
# Planting a payload into a test file, or reading one back unchecked, unpickles DeepSpeed's classes
# for real (torch.load without weights_only): those tests need DeepSpeed installed.
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="needs DeepSpeed to re-pickle its classes in a test file")
MODEL = "mp_rank_00_model_states.pt"


class SystemBomb:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class OpenBomb(SystemBomb):
    """Unpickling it creates ``marker`` with the builtin open."""

    def __reduce__(self):
        return (builtins.open, (self.marker, "w"))


class FakeEngine:
    """Pickled under a DeepSpeed module path that is not on the allowlist."""

    def __reduce__(self):
        return (FakeEngine, ())


class _EnginePickler(pickle._Pickler):
    def save_global(self, obj, name=None):
        if obj is FakeEngine:
            self.write(pickle.GLOBAL + b"deepspeed.runtime.engine\nDeepSpeedEngine\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


def _plant(folder, fname: str, payload, legacy: bool = False) -> None:
    """Put ``payload`` into a real-looking DeepSpeed file (beside its genuine content)."""
    path = os.path.join(folder, fname)
    sd = torch.load(path, weights_only=False)  # our own test file: trusted
    sd["client_state"] = payload
    _ds_save(sd, path) if not legacy else torch.save(sd, path, _use_new_zipfile_serialization=False)


def _cli(*args: str) -> int:
    return ckpt_cli.main(list(args))


@needs_deepspeed
@pytest.mark.parametrize("bomb", [SystemBomb, OpenBomb])
@pytest.mark.parametrize("where", [OPTIM0, MODEL])
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_hostile_pickle_never_runs_with_or_without_the_flag(tmp_path, capsys, comm, world, bomb, where, legacy):
    if world.Get_size() > 1:
        pytest.skip("single-process test (the CLI runs on the world)")
    marker = str(tmp_path / "pwned")
    src = tmp_path / "ds"
    make(str(src), 1, 2)
    _plant(src, where, {"x": bomb(marker)}, legacy)
    for flag in (False, True):
        with pytest.raises(PickleRefusedError, match=r"(posix|os|builtins|io)\.(system|open)") as info:
            read_deepspeed(src, allow_pickle=flag)
        assert "arbitrary code" in str(info.value) and where in str(info.value)
        with pytest.raises(PickleRefusedError):
            from_deepspeed(src, tmp_path / "ours", comm=comm, allow_pickle=flag)
        assert not (tmp_path / "ours").exists()
        code = _cli("convert", "--from", "deepspeed", str(src), str(tmp_path / "ours"),
                    *(["--allow-pickle"] if flag else []))
        err = capsys.readouterr().err
        assert code == ckpt_cli.EXIT_PICKLE and (".system" in err or ".open" in err), err
        assert not (tmp_path / "ours").exists()
    assert not os.path.exists(marker), "a pickle was executed"


@needs_deepspeed
def test_deepspeed_global_outside_the_allowlist_is_refused_by_name(tmp_path):
    src = tmp_path / "ds"
    make(str(src), 3, 2)
    path = src / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    sd = torch.load(path, weights_only=False)
    sd["engine"] = FakeEngine()
    torch.save(sd, path, pickle_module=type("M", (), {"Pickler": _EnginePickler, "__name__": "pickle"}))
    for flag in (False, True):
        with pytest.raises(PickleRefusedError, match=r"deepspeed\.runtime\.engine\.DeepSpeedEngine"):
            read_deepspeed(src, allow_pickle=flag)


def test_allowlist_stand_ins_run_no_deepspeed_code():
    assert sorted(DEEPSPEED_GLOBALS) == [
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler", "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address"]
    for name, cls in DEEPSPEED_GLOBALS.items():
        assert f"{cls.__module__}.{cls.__qualname__}" == name and cls.__module__.startswith("deepspeed.")
        assert cls.__mro__[1].__module__ == "ckpt.deepspeed.pickles"


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def entry_data_offset(path: str, entry: str) -> tuple[int, int]:
    """(offset in the file of ``entry``'s data, its size) from the zip's local header."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(entry)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def zero_inside_largest_tensor(path: str, nbytes: int = 64) -> str:
    """Zero ``nbytes`` in the middle of the largest tensor entry of ``path``; return its name."""
    with zipfile.ZipFile(path) as zf:
        data = [i for i in zf.infolist() if "/data/" in i.filename]
    entry = max(data, key=lambda i: i.file_size).filename
    off, size = entry_data_offset(path, entry)
    assert size >= nbytes, (entry, size)
    with open(path, "r+b") as f:
        f.seek(off + (size - nbytes) // 2)
        f.write(bytes(nbytes))
    return entry


@needs_deepspeed
@pytest.mark.mpi(min_size=1)
def test_crc_damaged_entry_is_refused_on_every_rank(comm, world, shared_tmp_path, capsys):
    src = shared_tmp_path / "ds"
    entry = None
    if world.Get_rank() == 0:
        make(str(src), 1, 1)
        assert check_zip(str(src / OPTIM0)) == []
        before = _tensors(torch.load(src / OPTIM0, weights_only=False))
        entry = zero_inside_largest_tensor(str(src / OPTIM0))
        # the damage is real and torch alone does not see it: it loads different values silently
        after = _tensors(torch.load(src / OPTIM0, weights_only=False))
        assert len(before) == len(after) and not all(torch.equal(a, b) for a, b in zip(before, after))
    entry = world.bcast(entry, root=0)

    def refused():
        with pytest.raises(ZipEntryError) as info:
            from_deepspeed(src, shared_tmp_path / "ours", comm=comm)
        msg = str(info.value)
        assert OPTIM0 in msg and entry in msg and "CRC" in msg, msg
        assert isinstance(info.value, ckpt.DamagedCheckpointError)
    check_all(refused)
    if world.Get_size() == 1:
        with pytest.raises(ZipEntryError, match=entry):
            read_deepspeed(src)
        code = _cli("convert", "--from", "deepspeed", str(src), str(shared_tmp_path / "ours"))
        err = capsys.readouterr().err
        assert code == ckpt_cli.EXIT_DAMAGED and entry in err, err
    world.Barrier()
    assert not (shared_tmp_path / "ours").exists()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("step", ["verify_files", "read_deepspeed"])
def test_a_failure_on_the_last_rank_alone_raises_on_every_rank(comm, world, shared_tmp_path, monkeypatch, step):
    """A rank that fails before the others reach a step's collective never leaves them waiting."""
    from ckpt.deepspeed import api as ds_api

    src = shared_tmp_path / "ds"
    if world.Get_rank() == 0:
        make(str(src), 1, 1)
    world.Barrier()
    if world.Get_rank() == world.Get_size() - 1:
        def broken(*_a, **_k):
            raise OSError("disk gone on this rank")
        monkeypatch.setattr(ds_api, step, broken)

    def refused():
        with pytest.raises(OSError) as info:
            from_deepspeed(src, shared_tmp_path / "ours", comm=comm)
        assert f"rank {world.Get_size() - 1}" in str(info.value) and "disk gone" in str(info.value)
    check_all(refused)
    world.Barrier()
    assert not (shared_tmp_path / "ours").exists()


def test_truncated_zip_entry_is_refused(tmp_path):
    src = tmp_path / "ds"
    make(str(src), 3, 2)
    path = str(src / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    with zipfile.ZipFile(path) as zf:
        entry = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    # claim a larger size in the central directory than the entry holds
    raw = bytearray(open(path, "rb").read())
    name = entry.filename.encode()
    cd = raw.find(b"PK\x01\x02", 0)
    while raw[cd + 46:cd + 46 + len(name)] != name:
        cd = raw.find(b"PK\x01\x02", cd + 4)
    struct.pack_into("<I", raw, cd + 24, entry.file_size + 8)  # uncompressed size
    open(path, "wb").write(bytes(raw))
    with pytest.raises(ZipEntryError, match=entry.filename):
        read_deepspeed(src)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("stage", [1, 3])
def test_real_layouts_import_without_a_flag(comm, world, shared_tmp_path, stage):
    src = shared_tmp_path / "ds"
    if world.Get_rank() == 0:
        make(str(src), stage, 2, torch.bfloat16)
    world.Barrier()
    m = from_deepspeed(src, shared_tmp_path / "ours", comm=comm)
    t = truth()

    def check():
        assert m.step == 5
        st = read_deepspeed(src)
        for n in SHAPES:
            for k in ("fp32", "exp_avg", "exp_avg_sq"):
                assert _same(st.tensors[n][k], t[n][k]), (n, k)
    check_all(check)
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(src)
