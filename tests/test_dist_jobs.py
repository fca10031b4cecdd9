"""Whole jobs on the "mpicomm" backend: timeouts raise in the caller, bad launches get clear errors."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from mpitest import mpiexec_cmd

from mpicomm import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra) -> dict:
    env = clean_env()
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _mpiexec(n: int) -> list[str]:
    return mpiexec_cmd(n)


_SKIP_JOB = r"""
import datetime, sys, time
if sys.argv[1] == "serialized":  # no progress thread: the caller tests, the deadline thread expires
    import mpi4py
    mpi4py.rc.thread_level = "serialized"
import torch, torch.distributed as dist, mpicomm
from mpicomm.distributed import ProcessGroupTimeoutError
kind, timeout = sys.argv[1], float(sys.argv[2])
dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=timeout))
t = torch.ones(1 << 18)
if dist.get_rank() == 0:
    began = time.monotonic()
    try:
        if kind == "blocking":
            dist.all_reduce(t)
        elif kind in ("async", "serialized"):
            dist.all_reduce(t, async_op=True).wait()
        else:
            dist.recv(t, src=1)
    except ProcessGroupTimeoutError as exc:
        print(f"raised after {time.monotonic() - began:.2f} s: {exc}", flush=True)
    else:
        raise AssertionError("the skipped call did not time out")
    try:
        dist.all_reduce(t)
    except RuntimeError as exc:
        print(f"then refused: {exc}", flush=True)
    else:
        raise AssertionError("the broken group took another call")
else:
    time.sleep(2 * timeout)  # this rank skips the call
dist.destroy_process_group()
dist.init_process_group("mpicomm")  # a new group works
t = torch.full((4,), float(dist.get_rank()))
dist.all_reduce(t)
n = dist.get_world_size()
assert torch.equal(t, torch.full((4,), n * (n - 1) / 2)), t
dist.destroy_process_group()
print("rank", dist.get_rank() if dist.is_initialized() else "-", "carried on", flush=True)
"""


@pytest.mark.parametrize("kind,op,n", [("blocking", "all_reduce", 2), ("async", "all_reduce", 2),
                                       ("recv", "recv", 2), ("blocking", "all_reduce", 4),
                                       ("serialized", "all_reduce", 2)])
def test_a_skipped_call_raises_in_the_caller_and_a_new_group_works(tmp_path, kind, op, n):
    timeout = 3.0
    script = tmp_path / "skip.py"
    script.write_text(_SKIP_JOB)
    proc = subprocess.run([*_mpiexec(n), sys.executable, "-m", "mpi4py", str(script), kind,
                           str(timeout)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("carried on") == n, out
    raised = [line for line in out.splitlines() if line.startswith("raised after ")]
    assert len(raised) == 1, out
    waited = float(raised[0].split()[2])
    # gloo's contract: not before the timeout; the slack is for a loaded machine
    assert timeout - 0.1 <= waited < timeout + 10, raised[0]
    assert f"{op} (float32[262144]; 1.0 MiB)" in raised[0], out
    assert "within the process group's timeout of 3 s" in raised[0], out
    for peer in range(1, n):
        assert f"rank {peer}: did not arrive" in raised[0], out
    assert "then refused:" in out and "unusable after an earlier timeout" in out, out
    # what MPI could not cancel is named as the process exits, and the exit is clean
    assert "operation(s) that timed out still pending in MPI" in out, out
    assert "MPI_Abort" not in out and "aborting" not in out, out


_INIT_JOB = r"""
import torch, torch.distributed as dist, mpicomm
dist.init_process_group("mpicomm")
print("initialised", dist.get_rank(), flush=True)
"""


def test_launcher_rank_that_disagrees_with_mpi_is_an_error_on_every_rank(tmp_path):
    script = tmp_path / "init.py"
    script.write_text(_INIT_JOB)
    proc = subprocess.run([*_mpiexec(2), sys.executable, "-m", "mpi4py", str(script)], cwd=ROOT,
                          env=_env(RANK="1", WORLD_SIZE="2"), capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "initialised" not in out, out
    assert "RANK=1 (set by the launcher or passed as an argument) disagrees with MPI (rank 0 of 2" in out, out


def test_plain_init_under_mpiexec_at_4_ranks(tmp_path):
    script = tmp_path / "init.py"
    script.write_text(_INIT_JOB + "t = torch.ones(1); dist.all_reduce(t)\nimport pathlib, sys\n"
                      "pathlib.Path(sys.argv[1], f'rank{dist.get_rank()}').write_text("
                      "f'{dist.get_world_size()} {t.item()}')\n")
    proc = subprocess.run([*_mpiexec(4), sys.executable, "-m", "mpi4py", str(script),
                           str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert [(tmp_path / f"rank{r}").read_text() for r in range(4)] == ["4 4.0"] * 4, out


def test_plain_init_under_mpiexec_with_local_world_size_exported(tmp_path):
    """LOCAL_WORLD_SIZE (accelerate sets it) is no sign of torchrun: MPI still gives the ranks."""
    script = tmp_path / "init.py"
    script.write_text(_INIT_JOB + "t = torch.ones(1); dist.all_reduce(t)\nimport sys\n"  # one write per line:
                      "sys.stdout.write(f'sum {dist.get_rank()} {t.item()}\\n'); sys.stdout.flush()\n")  # no interleaving
    proc = subprocess.run([*_mpiexec(2), sys.executable, "-m", "mpi4py", str(script)], cwd=ROOT,
                          env=_env(LOCAL_WORLD_SIZE="2"), capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "sum 0 2.0" in out and "sum 1 2.0" in out, out


def test_torchrun_gets_told_to_use_mpiexec(tmp_path):
    script = tmp_path / "init.py"
    script.write_text(_INIT_JOB)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "initialised" not in out, out
    assert "launch the script with `mpiexec -n 2 python script.py`" in out, out


_SERIALIZED_JOB = r"""
import mpi4py
mpi4py.rc.thread_level = "serialized"
from mpi4py import MPI
import torch, torch.distributed as dist, mpicomm
from mpicomm import progress_thread
assert MPI.Query_thread() < MPI.THREAD_MULTIPLE and not progress_thread.enabled()
dist.init_process_group("mpicomm")
n = dist.get_world_size()
t = torch.full((1 << 16,), float(dist.get_rank() + 1))
work = dist.all_reduce(t, async_op=True)
assert work.is_completed(), "below THREAD_MULTIPLE an async call completes before it returns"
assert torch.equal(t, torch.full_like(t, n * (n + 1) / 2))
assert torch.equal(work.get_future().wait()[0], t)
import pathlib, sys
pathlib.Path(sys.argv[1], f"ok.{dist.get_rank()}").write_text(f"pending {progress_thread.pending()}")
"""


def test_below_thread_multiple_async_calls_complete_before_returning(tmp_path):
    script = tmp_path / "serialized.py"
    script.write_text(_SERIALIZED_JOB)
    proc = subprocess.run([*_mpiexec(2), sys.executable, str(script), str(tmp_path)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert [(tmp_path / f"ok.{r}").read_text() for r in range(2)] == ["pending 0"] * 2, out


_DDP_FAILED_BUCKET_JOB = r"""
import torch, torch.distributed as dist, mpicomm
from torch.nn.parallel import DistributedDataParallel as DDP
from mpicomm.distributed import _pg
dist.init_process_group("mpicomm")
model = DDP(torch.nn.Linear(4, 4))
real = _pg.MpicommProcessGroup.allreduce


def failing(self, tensors, opts):  # a bucket's all-reduce that fails as when a peer died
    work = real(self, tensors, opts)
    work.wait()
    work._error = mpicomm.RankFailedError("all_reduce: rank 1 failed (injected)", (1,))
    return work


_pg.MpicommProcessGroup.allreduce = failing
try:
    model(torch.randn(2, 4)).sum().backward()
except RuntimeError as exc:
    print("backward raised:", exc)
else:
    raise AssertionError("backward did not raise")
"""


def test_a_failed_bucket_all_reduce_raises_from_ddp_backward(tmp_path):
    """DDP's built-in path reads the group's future in C++: a failed call must be an error
    there (a Python future's set_exception is a value to C++, and crashed the process)."""
    script = tmp_path / "ddp_failed.py"
    script.write_text(_DDP_FAILED_BUCKET_JOB)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "backward raised:" in out and "RankFailedError: all_reduce: rank 1 failed" in out, out
