"""Every program in examples/ runs as documented (mpiexec -n 2) and exits cleanly."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from mpitest import mpiexec_cmd

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
#: run on every MPI in CI (ULFM's recovery under Open MPI, the first collectives); the others are
#: marked ``once``: what they call is tested on every MPI by the suite itself
EVERY_MPI = ("collectives", "elastic_ddp", "elastic_zero", "horovod_elastic_synthetic_benchmark")


@pytest.mark.parametrize("path", [pytest.param(p, marks=() if p.stem in EVERY_MPI else pytest.mark.once)
                                  for p in EXAMPLES], ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore::FutureWarning", MPICOMM_EXAMPLE_DIR=str(tmp_path))
    proc = subprocess.run([*mpiexec_cmd(2), sys.executable, "-m", "mpi4py", str(path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip(), f"{path.name} printed nothing"
