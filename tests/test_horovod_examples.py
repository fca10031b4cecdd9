"""The Horovod-style examples (examples/horovod_*.py) run at 2 ranks: MNIST-style training on
synthetic digits, the synthetic benchmark, and its elastic version (no failure here; the
elastic fault cases are in tests/test_horovod_elastic.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from mpi4py import MPI

from mpicomm import clean_env
from mpitest import mpiexec_cmd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, *args: str) -> str:
    env = clean_env()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([*mpiexec_cmd(2), sys.executable, "-m", "mpi4py",
                           os.path.join(ROOT, "examples", script), *args],
                          capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="launches its own MPI jobs")


def test_mnist_learns_and_keeps_the_ranks_equal():
    out = _run("horovod_mnist.py", "--epochs", "3", "--lr", "0.02")
    m = re.search(r"accuracy ([\d.]+)%, weights equal on all 2 ranks: True", out)
    assert m, out[-3000:]
    assert float(m.group(1)) > 25.0, out[-3000:]     # chance is 10%


def test_mnist_with_fp16_allreduce():
    out = _run("horovod_mnist.py", "--epochs", "1", "--samples", "256", "--fp16-allreduce")
    assert "weights equal on all 2 ranks: True" in out, out[-3000:]


def test_synthetic_benchmark_reports_throughput():
    out = _run("horovod_synthetic_benchmark.py", "--num-iters", "2", "--num-batches-per-iter", "2")
    m = re.search(r"total img/sec on 2 rank\(s\): ([\d.]+)", out)
    assert m and float(m.group(1)) > 0, out[-3000:]


def test_elastic_synthetic_benchmark_runs_without_failures():
    out = _run("horovod_elastic_synthetic_benchmark.py", "--num-iters", "2")
    assert "done: 2 iterations, weights equal on all 2 ranks: True" in out, out[-3000:]
