"""A rank dies under ULFM (`mpirun --with-ft ulfm`): survivors raise RankFailedError and go on.

Each case is one 3-rank job of tests/fault_job.py, launched from this single process with the
venv's mpiexec (skipped unless it is Open MPI built with ULFM, e.g. on MPICH).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from mpitest import mpiexec_cmd, mpiexec_path

from mpicomm import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "fault_job.py")
#: a survivor's error must come this soon after the death (seconds)
DETECT_S = 2.0


def _ulfm_mpiexec() -> str:
    """The venv's mpiexec if it is Open MPI with ULFM; skip otherwise."""
    mpiexec = mpiexec_path()
    info = os.path.join(os.path.dirname(mpiexec), "ompi_info")
    if not os.path.exists(info):
        info = shutil.which("ompi_info") or ""
    if not info:
        pytest.skip("not Open MPI (no ompi_info): no ULFM here")
    text = subprocess.run([info], capture_output=True, text=True, timeout=60).stdout
    if "FT MPI support: yes" not in text:
        pytest.skip("this Open MPI is built without ULFM (ompi_info: FT MPI support is not yes)")
    return mpiexec


def _run_case(tmp_path, case: str, victim: int, n: int = 3) -> str:
    _ulfm_mpiexec()
    env = clean_env()
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "OMPI_MCA_btl",
              "OMPI_MCA_mpi_ft_enable"):
        env.pop(k, None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [*mpiexec_cmd(n)]
    cmd[cmd.index("-n"):cmd.index("-n")] = ["--with-ft", "ulfm"]
    try:
        proc = subprocess.run([*cmd, sys.executable, "-m", "mpi4py", JOB, case, str(victim),
                               str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"case {case}: the job hung (killed after {exc.timeout} s):\n"
                             f"{exc.stdout}\n{exc.stderr}") from None
    out = proc.stdout + proc.stderr
    oks = [line.split() for line in proc.stdout.splitlines() if line.startswith("OK ")]
    survivors = sorted(set(range(n)) - {victim})
    assert sorted(int(w[3]) for w in oks) == survivors, out
    for w in oks:
        assert w[1] == case and float(w[5]) < DETECT_S, (w, out)
    return out


def test_a_killed_rank_raises_on_survivors_who_shrink_and_reinit_the_process_group(tmp_path):
    """The launch as a user types it: no transport options (mpicomm chooses TCP under ULFM)."""
    _run_case(tmp_path, "plain", victim=1)


@pytest.mark.parametrize("case,victim", [("plain_async", 2), ("process_group", 0)])
def test_failures_surface_in_every_path(tmp_path, case, victim):
    _run_case(tmp_path, case, victim)
