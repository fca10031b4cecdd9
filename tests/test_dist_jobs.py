"""Whole jobs on the "mpicomm" backend: timeouts end the job, bad launches get clear errors."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

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
import datetime, pathlib, sys, time
if sys.argv[1] == "serialized":  # no progress thread: the caller tests, the deadline thread expires
    import mpi4py
    mpi4py.rc.thread_level = "serialized"
import torch, torch.distributed as dist, mpicomm
kind, timeout, stamp = sys.argv[1], float(sys.argv[2]), pathlib.Path(sys.argv[3])
dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=timeout))
t = torch.ones(1 << 18)
if dist.get_rank() == 0:
    stamp.write_text(repr(time.time()))
    if kind == "blocking":
        dist.all_reduce(t)
    elif kind in ("async", "serialized"):
        dist.all_reduce(t, async_op=True).wait()
    else:
        dist.recv(t, src=1)
else:
    time.sleep(20 * timeout)  # this rank skips the call
print("rank", dist.get_rank(), "got past the skipped call", flush=True)
"""


@pytest.mark.parametrize("kind,op,n", [("blocking", "all_reduce", 2), ("async", "all_reduce", 2),
                                       ("recv", "recv", 2), ("blocking", "all_reduce", 4),
                                       ("serialized", "all_reduce", 2)])
def test_a_skipped_call_ends_the_job_with_its_description(tmp_path, kind, op, n):
    timeout = 4.0
    script = tmp_path / "skip.py"
    script.write_text(_SKIP_JOB)
    stamp = tmp_path / "stamp"
    # Blocking: the deadline thread aborts the job; it runs without mpi4py's abort-on-exception.
    # Below MPI_THREAD_MULTIPLE: the timeout's exception ends rank 0, whose exit aborts the job.
    runner = [] if kind in ("blocking", "serialized") else ["-m", "mpi4py"]
    proc = subprocess.run([*_mpiexec(n), sys.executable, *runner, str(script), kind,
                           str(timeout), str(stamp)], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
    ended = time.time()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "got past the skipped call" not in out
    assert stamp.exists(), out
    # the subject is timing (the job ends within about twice the timeout, not after the skipping
    # rank's 20); the slack is generous for a loaded machine's MPI teardown
    assert ended - float(stamp.read_text()) < 2 * timeout + 10, f"took {ended - float(stamp.read_text()):.1f} s"
    assert f"{op} (float32[262144]; 1.0 MiB)" in out, out
    assert "within the process group's timeout of 4 s" in out, out
    for peer in range(1, n):
        assert f"rank {peer}: did not arrive" in out, out
    if kind == "blocking":
        assert "mpicomm: aborting the MPI job after a timeout" in out, out


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
    script.write_text(_INIT_JOB + "t = torch.ones(1); dist.all_reduce(t)\n"
                      "print('sum', dist.get_rank(), t.item(), flush=True)\n")
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


class _Stream:
    """stderr/stdout stand-in: records writes in ``events``, or fails every call (broken)."""

    def __init__(self, events: list, broken: bool = False) -> None:
        self.events, self.broken = events, broken

    def write(self, text):
        if self.broken:
            raise OSError("broken pipe")
        self.events.append(("write", text))

    def flush(self):
        if self.broken:
            raise OSError("broken pipe")


def test_abort_writes_the_reason_waits_then_aborts_even_with_broken_streams(monkeypatch):
    """The reason is written before the grace wait, the wait comes before MPI_Abort; a closed or
    broken stream never keeps the job from being aborted (that would be a hang)."""
    from mpicomm.distributed import _work

    events = []

    class FakeWorld:
        def Abort(self, code):
            events.append(("abort", code))

    monkeypatch.setattr(_work, "MPI", type("FakeMPI", (), {"COMM_WORLD": FakeWorld()}))
    fake_time = type("FakeTime", (), {"sleep": staticmethod(lambda s: events.append(("sleep", s))),
                                      "monotonic": staticmethod(time.monotonic)})
    monkeypatch.setattr(_work, "time", fake_time)  # _work's own reference only
    monkeypatch.setattr(sys, "stdout", _Stream(events))
    monkeypatch.setattr(sys, "stderr", _Stream(events))
    _work._abort("a peer never arrived")
    assert events == [("write", "mpicomm: aborting the MPI job after a timeout: a peer never arrived\n"),
                      ("sleep", _work.ABORT_GRACE_S), ("abort", 1)]
    assert _work.ABORT_GRACE_S > 0
    events.clear()
    monkeypatch.setattr(sys, "stdout", _Stream(events, broken=True))
    monkeypatch.setattr(sys, "stderr", _Stream(events, broken=True))
    _work._abort("again")
    assert events == [("sleep", _work.ABORT_GRACE_S), ("abort", 1)]
