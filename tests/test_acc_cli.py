"""``python -m accelerators``: the diagnosis as one process and under mpiexec -n 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from mpi4py import MPI
from mpitest import mpiexec_cmd

from mpicomm import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                                reason="starts its own processes; run in the single-process pass")


def _env(**extra):
    env = clean_env(drop=("SLURM_", "MPICOMM_"))  # user settings such as OMPI_ALLOW_RUN_AS_ROOT pass
    env.update(extra)
    return env


def _run(args, timeout=120, **extra):
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=_env(**extra))


def test_single_process_json():
    proc = _run([sys.executable, "-m", "accelerators", "--json"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (report,) = json.loads(proc.stdout)
    assert report["accelerator"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert report["selected_by"].startswith("auto: torch.cuda.is_available()")
    assert (report["rank"], report["size"], report["local_rank"]) == (0, 1, 0)
    assert report["local_rank_source"] == "MPI Split_type(COMM_TYPE_SHARED)"
    assert report["cuda_aware"] in ("yes", "no", "unknown") and report["cuda_aware_reason"]
    assert report["mpi"]["vendor"].startswith(MPI.get_vendor()[0])


def test_overrides_show_in_the_text_report():
    proc = _run([sys.executable, "-m", "accelerators"], MPICOMM_ACCELERATOR="cpu",
                MPICOMM_LOCAL_RANK="3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "accelerator:      cpu (MPICOMM_ACCELERATOR=cpu)" in out
    assert "local rank:       3 of 1 (from MPICOMM_LOCAL_RANK)" in out
    assert "WARNING:" in out and "not below the local size 1" in out  # one process on the node
    assert "CUDA-aware MPI:   no (source: cpu accelerator)" in out
    assert "MPI CUDA support:" in out


def test_bad_override_is_reported():
    proc = _run([sys.executable, "-m", "accelerators"], MPICOMM_ACCELERATOR="tpu")
    assert proc.returncode == 1
    assert "MPICOMM_ACCELERATOR='tpu' is not a known accelerator; expected one of: cpu, cuda" \
        in proc.stdout


def test_under_mpiexec_two_ranks():
    proc = _run([*mpiexec_cmd(2), sys.executable, "-m", "accelerators", "--json"],
                timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = json.loads(proc.stdout)
    assert [r["rank"] for r in reports] == [0, 1] and {r["size"] for r in reports} == {2}
    assert sorted(r["local_rank"] for r in reports) == [0, 1]
    for r in reports:
        assert r["local_rank_source"] not in ("default", "MPICOMM_LOCAL_RANK"), r
        assert r["local_rank_warnings"] == [], r
