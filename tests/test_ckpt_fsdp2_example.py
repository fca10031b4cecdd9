"""examples/fsdp2_ckpt.py as documented: saved by 2 ranks, resumed at 3 ranks and at 1."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from mpitest import mpiexec_cmd

from mpicomm import clean_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "fsdp2_ckpt.py"


def test_fsdp2_example_saves_at_2_and_resumes_at_3_and_1(tmp_path):
    env = clean_env()
    env.update(PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    outs = {}
    for n in (2, 3, 1):
        proc = subprocess.run([*mpiexec_cmd(n), sys.executable, "-m", "mpi4py", str(EXAMPLE), str(tmp_path)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"at {n} ranks:\n{proc.stdout}\n{proc.stderr[-3000:]}"
        outs[n] = proc.stdout
    assert "saved" in outs[2] and "trained 3 steps at 2 ranks" in outs[2]
    for n in (2, 3, 1):
        assert f"saved at 2 ranks, step 3; resumed at {n} ranks: weights equal the file's: True" in outs[n], outs[n]
        assert "AdamW step 3" in outs[n]
    assert "trained" not in outs[3] and "plain module: weights equal: True" in outs[1]
