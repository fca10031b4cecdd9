"""The checkpoint benchmark program runs end to end on a tiny model and checks what it loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.records import validate_record
from mpitest import mpiexec_cmd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize("n,save,load", [(1, 1, 1), (2, 1, 2), (3, 2, 3)])
def test_bench_ckpt_small_run(n, save, load, tmp_path):
    out = tmp_path / "ckpt.json"
    launch = [*mpiexec_cmd(n), sys.executable] if n > 1 else [sys.executable]
    proc = subprocess.run(
        [*launch, "-m", "bench", "ckpt", "--layers", "2", "--hidden", "96", "--save-ranks",
         str(save), "--load-ranks", str(load), "--deepspeed", "no", "--no-sync", "--new-dir-reps", "2", "--dir",
         str(tmp_path), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# all values correct (#wrong = 0)" in proc.stdout, proc.stdout
    records = json.loads(out.read_text())["records"]
    for rec in records:                          # the one record schema of every bench program
        assert validate_record(rec) == [], rec
        assert rec["bench"] == "ckpt" and rec["wrong"] == 0, rec
    ops = [r["op"] for r in records]
    for op in ("disk write+fdatasync", "ckpt.save (fsync)", "ckpt.load", "ckpt save + load",
               "DeepSpeed save+convert+load", "ckpt.save (no fsync)", "FSDP2 ckpt save + load",
               "FSDP2 DCP save + load", "FSDP2 time DCP / ckpt", "FSDP2 async save, first: blocks",
               "FSDP2 async save: blocks", "FSDP2 async save, background: blocks", "new dir: ckpt.save (fsync)",
               "new dir: ckpt.save nosync + os.sync", "new dir: DCP save + os.sync", "new dir: ckpt.load",
               "new dir: DCP load", "new dir: time DCP / ckpt"):
        assert op in ops, ops
    newdir = next(r for r in records if r["op"] == "new dir: ckpt.load")
    assert "state checked" in newdir["note"] and "read data" in newdir["note"], newdir
    loaded = next(r for r in records if r["op"] == "ckpt.load")
    assert loaded["note"] == "state checked" and loaded["size_bytes"] == 2 * (96 * 96 + 96) * 12
    assert loaded["ranks"] == load
    ds = next(r for r in records if r["op"] == "DeepSpeed save+convert+load")
    assert ds["time_s"] is None and ds["note"] == "not run: --deepspeed no", ds
    assert "goal" not in proc.stdout and "speed-up" not in proc.stdout
    assert sum(1 for r in records if r["op"].startswith("load peak RSS")) == load


def test_bench_ckpt_says_how_many_ranks_it_needs():
    proc = subprocess.run([sys.executable, "-m", "bench", "ckpt", "--save-ranks", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "expected at least 3 ranks" in proc.stderr, proc.stderr
