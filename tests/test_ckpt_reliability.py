"""ckpt under failure: ranks killed mid-save, damaged files, mismatched models, hostile files,
concurrent saves to one path, and a failure on one rank of a collective save or load.

The multi-process cases launch their own small ``mpiexec -n 2`` jobs (a script written to a
temporary folder) and inspect the result from this process; they run single-process only."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
import zlib

import pytest
from mpicomm import clean_env
import torch
from mpi4py import MPI

import ckpt
from zero import ZeroOptimizer
import mpicomm
from ckpt import cli as ckpt_cli
from ckpt import io as ckpt_io
from ckpt.optimizers import ZeroPlanner
from conftest import single_process
from mpitest import assert_all, mpiexec_cmd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(seed: int = 0, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))


def self_comm():
    return mpicomm.as_communicator(MPI.COMM_SELF)


def save_small(path, seed=0, step=1, **kw):
    """A one-rank save (in this process) of a small model with Adam state."""
    model = make_model(seed)
    opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=1, comm=self_comm(), lr=0.01)
    model(torch.ones(2, 6)).sum().backward()
    opt.step()
    m = ckpt.save(path, model=model, optimizer=opt, step=step, comm=MPI.COMM_SELF, **kw)
    return model, m


def cli(*args: str, capsys=None) -> tuple[int, str, str]:
    """``python -m ckpt ARGS`` in this process: (exit code, stdout, stderr)."""
    code = ckpt_cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# ---------------------------------------------------------------------------------------------
# jobs of their own: a script run under mpiexec

CHILD = r'''
import json, os, signal, sys, time
import torch
from mpi4py import MPI
import ckpt
from ckpt import checksum, commit, direct_io, io

mode, root = sys.argv[1], sys.argv[2]
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()


def model_filled(value, n=256):
    """Every weight equal to ``value``: a mix of two saves would show in the values."""
    m = torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.Linear(n, 4))
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(value)
    return m


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


if mode in ("kill-mid-write", "kill-before-publish", "kill-before-manifest"):
    torch.manual_seed(1)
    first = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    ckpt.save(os.path.join(root, "step1"), model=first, step=1, block_size=4096, chunk_bytes=4096)
    torch.manual_seed(2)
    second = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    if mode == "kill-mid-write" and rank == size - 1:
        real, real_direct, calls = io._round, direct_io.pwrite_all, []

        def dying_round(fh, batch, mem, call):
            calls.append(1)
            if len(calls) == 2:  # one round of data written, the rest not
                die()
            return real(fh, batch, mem, call)

        def dying_write(fd, mem, offset):  # the same, where the data goes by O_DIRECT
            calls.append(1)
            if len(calls) == 2:
                die()
            return real_direct(fd, mem, offset)

        io._round, direct_io.pwrite_all = dying_round, dying_write
    if mode == "kill-before-publish" and rank == 0:
        commit.publish = lambda *a, **k: die()  # data and manifest written, not yet renamed
    if mode == "kill-before-manifest" and rank == 0:
        checksum.blocks_from_parts = lambda *a, **k: die()
    ckpt.save(os.path.join(root, "step2"), model=second, step=2, block_size=4096, chunk_bytes=4096)
    print("save returned", flush=True)  # never reached

elif mode == "concurrent":
    value = float(sys.argv[3])
    go = os.path.join(root, "go")
    model = model_filled(value)
    world.Barrier()
    if rank == 0:
        open(os.path.join(root, f"ready.{sys.argv[3]}"), "w").close()
    deadline = time.time() + 60
    while not os.path.exists(go) and time.time() < deadline:  # both jobs start their saves together
        time.sleep(0.005)
    results = {}
    for name, overwrite in (("excl", False), ("over", True)):
        try:
            ckpt.save(os.path.join(root, name), model=model, step=int(value), overwrite=overwrite,
                      block_size=4096, chunk_bytes=8192)
            results[name] = "ok"
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {exc}"
        world.Barrier()
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
'''


def start_job(tmp_path, *args: str, n: int = 2) -> subprocess.Popen:
    script = tmp_path / "ckpt_child.py"
    if not script.exists():
        script.write_text(CHILD)
    env = clean_env()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.Popen([*mpiexec_cmd(n), sys.executable, "-m", "mpi4py", str(script), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def finish_job(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"job timed out (hung?)\n{out[-2000:]}\n{err[-2000:]}")
    return proc.returncode, out, err


@single_process
@pytest.mark.parametrize("mode", ["kill-mid-write", "kill-before-manifest", "kill-before-publish"])
def test_rank_killed_during_save(tmp_path, capsys, mode):
    root = tmp_path / "run"
    code, out, err = finish_job(start_job(tmp_path, mode, str(root)))
    assert code != 0 and "save returned" not in out, f"the job should have died: {code}\n{out}\n{err[-2000:]}"

    # the previous checkpoint is intact, named by latest, loads and verifies
    assert (root / "latest").read_text().strip() == "step1"
    assert not (root / "step2").exists()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    info = ckpt.load(root, model=model, comm=MPI.COMM_SELF)
    torch.manual_seed(1)
    assert info.step == 1 and info.world_size == 2 and same_state(
        model, torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)))
    assert cli("verify", str(root), capsys=capsys)[0] == 0

    # the partial save is refused by name everywhere
    partial = [p for p in os.listdir(root) if ".tmp-" in p]
    assert len(partial) == 1, os.listdir(root)
    pdir = root / partial[0]
    with pytest.raises(ckpt.IncompleteCheckpointError, match="incomplete checkpoint"):
        ckpt.load(pdir, model=model, comm=MPI.COMM_SELF)
    for cmd in ("verify", "inspect"):
        code, out, err = cli(cmd, str(pdir), capsys=capsys)
        assert code == ckpt_cli.EXIT_INCOMPLETE and "incomplete checkpoint" in err, (cmd, code, err)
    assert ckpt.incomplete_reason(pdir) is not None


@single_process
def test_concurrent_saves_to_one_path_never_mix(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    jobs = [start_job(tmp_path, "concurrent", str(root), v) for v in ("1", "2")]
    deadline = time.time() + 120  # both jobs ready (every rank's model built), then go together
    while not all((root / f"ready.{v}").exists() for v in ("1", "2")):
        assert time.time() < deadline and all(j.poll() is None for j in jobs), "a job ended or hung before its save"
        time.sleep(0.01)
    (root / "go").write_text("")
    results = []
    for j in jobs:
        code, out, err = finish_job(j)
        assert code == 0, f"{code}\n{out}\n{err[-3000:]}"
        results.append(json.loads(out.split("RESULT ", 1)[1]))

    excl = [r["excl"] for r in results]
    assert sorted(r == "ok" for r in excl) == [False, True], f"exactly one exclusive save wins: {excl}"
    loser = next(r for r in excl if r != "ok")
    assert loser.startswith("CheckpointExistsError") and "exists" in loser, loser
    assert [r["over"] for r in results] == ["ok", "ok"], results

    for name in ("excl", "over"):
        d = root / name
        m = ckpt.read_manifest(d)
        data = (d / "data.bin").read_bytes()
        bs = m.block_size
        assert m.files["data.bin"]["crc32"] == [zlib.crc32(data[i:i + bs]) for i in range(0, len(data), bs)]
        start = 8 + int.from_bytes(data[:8], "little")  # after the safetensors header
        values = torch.frombuffer(bytearray(data[start:]), dtype=torch.float32)
        assert values.numel() == (len(data) - start) // 4 and len(set(values.tolist())) == 1, \
            f"{name}: a mix of saves: values {sorted(set(values.tolist()))}"
        assert float(values[0]) == float(m.step), f"{name}: data from one save, manifest from the other"
    leftovers = [p for p in os.listdir(root) if ".tmp-" in p or ".old-" in p]
    assert not leftovers, leftovers


@single_process
def test_overwrite_with_and_without_an_atomic_swap(tmp_path, monkeypatch):
    from ckpt import commit

    for swap in (True, False):
        if not swap:
            monkeypatch.setattr(commit, "_RENAMEAT2", None)  # systems without renameat2: two renames
        root = tmp_path / f"swap-{swap}"
        save_small(root / "a", seed=1, step=1)
        saved, _ = save_small(root / "a", seed=2, step=2, overwrite=True)
        model = make_model(7)
        assert ckpt.load(root, model=model, comm=MPI.COMM_SELF).step == 2 and same_state(model, saved)
        assert sorted(os.listdir(root)) == ["a", "latest"]
    # a directory that appears under the final name while the save writes: refused, nothing left behind
    real = commit.publish

    def racing_publish(tmp, path, overwrite):
        os.makedirs(os.path.join(path, "someone-elses"))
        return real(tmp, path, overwrite)

    monkeypatch.setattr(commit, "publish", racing_publish)
    with pytest.raises(FileExistsError, match="another save may have committed it"):
        save_small(tmp_path / "race" / "a")
    assert sorted(os.listdir(tmp_path / "race")) == ["a"]
    assert os.listdir(tmp_path / "race" / "a") == ["someone-elses"]


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


# ---------------------------------------------------------------------------------------------
# a failure on one rank of a collective call raises on every rank (no hang)


def same_everywhere(world, caught, failed_rank, step):
    """Every rank raised the same exception (type and message), naming the step and the failing rank."""
    if world.Get_size() == 1:
        return  # one process: the step's own exception, unchanged
    seen = world.allgather((type(caught).__qualname__, str(caught)))
    assert_all(len(set(seen)) == 1, f"ranks raised different exceptions: {seen}")
    assert_all(isinstance(caught, ckpt.StepFailedError) and f"{step} failed on rank {failed_rank} of" in str(caught)
               and [(f.rank, f.type_name) for f in caught.failures][0][0] == failed_rank, str(caught))


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_failure_on_one_rank_raises_everywhere(comm, world, shared_tmp_path, monkeypatch):
    last = world.Get_size() - 1
    model = make_model()
    opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=2, comm=comm, lr=0.01)
    ckpt.save(shared_tmp_path / "good", model=model, optimizer=opt, step=1, comm=comm)
    real_host = ckpt_io._host

    def failing_host(t):
        if world.Get_rank() == last:
            raise MemoryError("device copy failed (simulated)")
        return real_host(t)

    monkeypatch.setattr(ckpt_io, "_host", failing_host)
    caught = None
    try:
        ckpt.save(shared_tmp_path / "bad", model=model, optimizer=opt, step=2, comm=comm,
                  block_size=64, chunk_bytes=64)
    except Exception as exc:  # noqa: BLE001
        caught = exc
    monkeypatch.undo()
    assert_all(isinstance(caught, MemoryError) and "device copy failed (simulated)" in str(caught),
               f"got {type(caught).__name__}: {caught}")
    same_everywhere(world, caught, last, "save (writing data)")
    assert_all(not (shared_tmp_path / "bad").exists() and ckpt.resolve(shared_tmp_path).endswith("good"))

    # load: a rank whose planning fails
    real_plan = ZeroPlanner.plan_load

    def failing_plan(*a, **k):
        if world.Get_rank() == last:
            raise RuntimeError("planning failed (simulated)")
        return real_plan(*a, **k)

    monkeypatch.setattr(ZeroPlanner, "plan_load", failing_plan)
    other = make_model(2)
    opt2 = ZeroOptimizer(torch.optim.Adam, other.parameters(), stage=1, comm=comm, lr=0.01)
    caught = None
    try:
        ckpt.load(shared_tmp_path, model=other, optimizer=opt2, comm=comm)
    except Exception as exc:  # noqa: BLE001
        caught = exc
    monkeypatch.undo()
    assert_all(isinstance(caught, RuntimeError) and "simulated" in str(caught), f"got {type(caught).__name__}: {caught}")
    same_everywhere(world, caught, last, "load (planning)")
    # load: a rank that fails to take the state it read (before the collective gather of weights)
    if world.Get_rank() == last:
        monkeypatch.setattr(opt2, "set_shard_state", lambda *a: (_ for _ in ()).throw(ValueError("simulated")))
    caught = None
    try:
        ckpt.load(shared_tmp_path, model=other, optimizer=opt2, comm=comm)
    except Exception as exc:  # noqa: BLE001
        caught = exc
    monkeypatch.undo()
    assert_all(isinstance(caught, ValueError) and "simulated" in str(caught), f"got {type(caught).__name__}: {caught}")
    same_everywhere(world, caught, last, "load (setting state)")

    ckpt.load(shared_tmp_path, model=other, optimizer=opt2, comm=comm)  # and the job goes on
    assert_all(same_state(other, model))
