"""The restart path (an MPI without ULFM: the launcher ends the job when a rank dies): a job with
``checkpoint_dir`` loses a rank and ends; the same script relaunched at another size resumes from
the newest checkpoint by itself and ends with the weights of a single-process reference run.

Each job (tests/elastic_disk_job.py) is launched from a one-process test with a timeout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

from elastic_job_lib import reference
from mpicomm import clean_env
from mpitest import mpiexec_cmd

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS = 7


def _launch(n: int, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = clean_env()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    cmd = [*mpiexec_cmd(n), sys.executable, "-m", "mpi4py", os.path.join(HERE, "elastic_disk_job.py"), *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise AssertionError(f"the job hung (killed after {timeout} s): {' '.join(cmd)}\n{err[-4000:]}") from None


@pytest.mark.parametrize("opt", ["zero2", "ddp", "fsdp2"])
def test_relaunch_at_another_size_resumes_from_the_newest_checkpoint(tmp_path, opt):
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("launches its own mpiexec jobs")
    if not MPI.Get_library_version().startswith("MPICH"):
        pytest.skip("the restart path is tested on MPICH (no ULFM: a dead rank ends the job)")
    ckdir, out = str(tmp_path / "ck"), str(tmp_path / "run")
    first = _launch(3, [opt, ckdir, str(STEPS), "1", "5", out])
    log = f"rc {first.returncode}\n{first.stdout[-2000:]}\n{first.stderr[-3000:]}"
    assert first.returncode != 0 and not os.path.exists(out + ".json"), log
    with open(os.path.join(ckdir, "latest")) as f:
        newest = f.read().strip()
    assert newest in ("step2", "step4"), (newest, log)    # a checkpoint every 2 commits; died at step 5
    second = _launch(2, [opt, ckdir, str(STEPS), "-1", "-1", out])
    log = f"rc {second.returncode}\n{second.stdout[-2000:]}\n{second.stderr[-3000:]}"
    assert second.returncode == 0, log
    with open(out + ".json") as f:
        info = json.load(f)
    assert info["resumed"]["commits"] == int(newest[4:]), (info, newest)
    assert info["resumed"]["saved_world_size"] == 3 and info["world_size"] == 2, info
    assert info["commits"] == STEPS, info
    got = np.load(out + ".npz")
    for i, ref in enumerate(reference(STEPS)):
        np.testing.assert_allclose(got[f"p{i}"], ref.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"param {i}")
