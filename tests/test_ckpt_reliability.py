"""ckpt under failure: ranks killed mid-save, concurrent saves to one path, an overwrite with and
without an atomic swap, and a failure on one rank of a collective save or load (damaged and
hostile files: tests/test_ckpt_hostile.py).

The multi-process cases launch their own small ``mpiexec -n 2`` jobs (a script written to a
temporary folder) and inspect the result from this process; they run single-process only."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib

import pytest
import torch
from mpi4py import MPI

import ckpt
from ckpt import cli as ckpt_cli
from ckpt import io as ckpt_io
from ckpt.optimizers import ZeroPlanner
from ckpt_small import cli, make_model, same_state, save_small
from conftest import single_process
from mpicomm import clean_env
from mpitest import assert_all, mpiexec_cmd
from zero import ZeroOptimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
