"""bench zero runs at 2 ranks, and its counted bytes match the sizes of what ZeRO must send."""
from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

from bench.records import validate_record
from compressed.wire_format import P1_TRAILER
from mpitest import mpiexec_cmd
from zero.quantize import BLOCK

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_bench_zero_counts_bytes(tmp_path):
    out = tmp_path / "zero.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([*mpiexec_cmd(2), sys.executable, "-m", "bench", "zero", "--hidden", "40",
                           "--layers", "2", "--mem-hidden", "40", "--mem-layers", "2", "--steps", "1",
                           "--batch", "4", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for title in ("step time", "overlap", "peak memory", "bytes each rank hands to MPI"):
        assert title in proc.stdout, proc.stdout
    records = json.loads(out.read_text())["records"]
    for rec in records:                          # the one record schema of every bench program
        assert validate_record(rec) == [], rec
        assert rec["bench"] == "zero" and rec["ranks"] == 2 and rec["wrong"] == 0, rec
    assert "all values correct" in proc.stdout, proc.stdout
    n = 2 * (40 * 40 + 40)                       # parameters of the MLP
    world = 2
    local1 = math.ceil(n / world)                # stage 1: the flat group split evenly
    rows = {r["peer"]: r for r in records if r["op"] == "bytes"}
    z1 = rows["ZeRO-1 Adam"]["by_call"]
    assert z1["Reduce_scatter_block"] == 4 * world * local1   # every padded fp32 gradient, once
    assert z1["Allgather"] == 4 * local1                      # this rank's fp32 master shard
    ob = rows["ZeRO-1 1-bit Adam (frozen)"]["by_call"]
    chunk = math.ceil(local1 / 8) * 8
    # one sign bit per element, each row ending with the sender's scale (compressed.wire_format)
    assert ob["Alltoall"] == world * (chunk // 8 + P1_TRAILER)
    assert "Reduce_scatter_block" not in ob and ob["Allgather"] == 4 * local1   # weights only, no fp32 else
    assert ob["Allreduce"] == z1["Allreduce"] == 5 * 8       # the one small check per step
    # int8 weight gather: one byte per element of the shard, one fp32 scale per block, padding to 4
    q = rows["ZeRO-1 1-bit Adam (frozen), int8 gather"]["by_call"]
    assert q["Allgather"] == math.ceil(local1 / BLOCK) * 4 + math.ceil(local1 / 4) * 4
    assert q["Alltoall"] == ob["Alltoall"]
    assert rows["ZeRO-1 Adam, int8 gather"]["by_call"]["Allgather"] == q["Allgather"]
    assert rows["ZeRO-1 Adam"]["bytes_per_step"] >= sum(z1.values())   # the busiest rank's total
    mem = [r for r in records if r["op"] == "memory"]
    assert len(mem) == 4 and all(r["peak_mib_per_rank"] is not None and len(r["peak_mib_per_rank"]) == 2
                                 or r["note"].startswith("did not run") for r in mem), mem
    times = [r for r in records if r["op"] == "time"]
    assert [r["peer"] for r in times][0] == "DDP+AdamW gloo" and times[0]["x_ddp_gloo"] == 1.0
