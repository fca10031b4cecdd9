"""The bench rows of compressed.fsdp, as users run them (2-rank jobs): bench train --curve
--curve-fsdp and bench collectives' mpicomm-pg-q8 and mpicomm-pg-q1 peers beside mpicomm-pg;
the q1 peer's check against the float64 simulation of the 1-bit reduce-scatter."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bench import common, train_curve
from mpitest import mpiexec_cmd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *args, timeout=300):
    out = tmp_path / "out.json"
    cmd = [*mpiexec_cmd(2), sys.executable, "-m", "mpi4py", "-m", "bench", *args,
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout, json.loads(out.read_text())["records"]


def test_curve_fsdp(tmp_path):
    stdout, recs = _run(tmp_path, "train", "--hidden", "32", "--layers", "2", "--batch", "4",
                        "--curve", "--curve-fsdp", "--curve-steps", "3")
    by = {r["peer"]: r for r in recs}
    assert list(by) == list(train_curve.CURVES + train_curve.FSDP_CURVES)
    for rec in recs:
        assert common.validate_record(rec) == [], rec
        assert rec["steps"] == 3 and rec["wrong"] == 0
    # the first step's loss comes before any update: every replica starts from the same weights
    r16, q8, q1 = (by[name]["losses"] for name in train_curve.FSDP_CURVES)
    assert abs(q8[0] - r16[0]) <= 1e-2 * r16[0] and abs(q1[0] - r16[0]) <= 1e-2 * r16[0]
    assert by["fsdp2-mpicomm-q8"]["bytes_per_step"] is None
    assert "with int8 weights and gradients (fsdp2-mpicomm-q8)" in stdout
    assert "with int8 weights and 1-bit gradients (fsdp2-mpicomm-q1)" in stdout


def test_collectives_q8_peer(tmp_path):
    stdout, recs = _run(tmp_path, "collectives", "--ops", "all_gather,reduce_scatter,broadcast",
                        "--peers", "mpicomm-pg,mpicomm-pg-q8", "--sizes", "8K", "--rounds", "1",
                        "--iters", "3", "--warmup", "1")
    got = {(r["op"], r["peer"]) for r in recs}
    assert got == {(op, p) for op in ("all_gather", "reduce_scatter", "broadcast")
                   for p in ("mpicomm-pg", "mpicomm-pg-q8")} - {("broadcast", "mpicomm-pg-q8")}
    assert all(r["wrong"] == 0 for r in recs)
    assert "peer mpicomm-pg-q8 skipped for broadcast" in stdout


def test_collectives_q1_peer(tmp_path):
    stdout, recs = _run(tmp_path, "collectives", "--ops", "reduce_scatter,all_gather",
                        "--peers", "mpicomm-pg,mpicomm-pg-q1", "--sizes", "8K,100K", "--rounds", "1",
                        "--iters", "3", "--warmup", "1", "--dtype", "float32", "bfloat16")
    got = {(r["op"], r["peer"], r["dtype"], r["size_bytes"]) for r in recs}
    sizes = {r["size_bytes"] for r in recs}
    assert len(sizes) == 2
    assert got == {(op, p, d, b) for op, p in (("reduce_scatter", "mpicomm-pg"), ("reduce_scatter", "mpicomm-pg-q1"),
                                               ("all_gather", "mpicomm-pg"))
                   for d in ("float32", "bfloat16") for b in sizes}
    assert all(r["wrong"] == 0 for r in recs)
    assert "peer mpicomm-pg-q1 skipped for all_gather" in stdout


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_bench_q1_check_counts_only_wrong_elements(name):
    """bench collectives' mpicomm-pg-q1 check: the float64 simulation's result (SUM, from a zero
    error, rows not a multiple of 8) passes on every rank; one element with its sign flipped, or
    off by a part in 10**4, is counted."""
    from bench import values
    from bench.collective_peers import _q1_signs, q1_wrong
    from test_cmp_fsdp_onebit import simulate_step

    n, per = 3, 45
    m8 = -(-per // 8) * 8
    rows = [values.as_float(values.to_host(values.as_float(values._pattern(i, np.arange(n * per), name), name)
                                           * _q1_signs(n * per), name), name).reshape(n, per) for i in range(n)]
    means = simulate_step(rows, [np.zeros(n * m8) for _ in range(n)])
    for rank in range(n):
        got = values.to_host(means[rank] * n, name)
        assert q1_wrong(got, rank, n, per, name) == 0
        flipped = values.to_host(means[rank] * n * np.where(np.arange(per) == 7, -1.0, 1.0), name)
        assert q1_wrong(flipped, rank, n, per, name) == 1
        if name == "float32":
            off = got.copy()
            off[3] *= np.float32(1 + 1e-4)
            assert q1_wrong(off, rank, n, per, name) == 1


def test_train_fsdp_prefetch(tmp_path):
    """bench train --fsdp-prefetch: the FSDP2 peers with explicit prefetching and async
    unshards (the quantized all-gather's async path) train, replicas agreeing."""
    _, recs = _run(tmp_path, "train", "--hidden", "32", "--layers", "2", "--batch", "4",
                   "--steps", "1", "--warmup", "1", "--rounds", "1", "--fsdp-prefetch",
                   "--peers", "fsdp2-mpicomm-r16,fsdp2-mpicomm-q8")
    assert [r["peer"] for r in recs] == ["fsdp2-mpicomm-r16", "fsdp2-mpicomm-q8"]
    assert all(r["wrong"] == 0 and r["trained_steps"] > 0 for r in recs)


def test_fsdp_call_cost_rows(capsys):
    """bench.fsdp_call_cost (one process): a row per op and dtype, the int8 call's cost beside
    the copy's; the transfer is faked only inside the run (the real one is back after it)."""
    import math

    from bench import fsdp_call_cost
    from compressed.fsdp import collectives

    before = collectives._communicator
    rows = fsdp_call_cost.main(["--kib", "4", "--calls", "3", "--rounds", "2"])
    assert collectives._communicator is before
    assert [(r["op"], r["dtype"]) for r in rows] == [
        ("all_gather", "float32"), ("reduce_scatter", "float32"),
        ("all_gather", "bfloat16"), ("reduce_scatter", "bfloat16")]
    for r in rows:
        assert all(t > 0 and math.isfinite(t) for t in (*r["q8_us"], *r["copy_us"]))
        assert r["extra_us"] == r["q8_us"][0] - r["copy_us"][0]
    assert "transfer replaced by a copy" in capsys.readouterr().out
    with pytest.raises(ValueError, match="expected ranks >= 2"):
        fsdp_call_cost.measure(ranks=1)


def test_onebit_warmup_program(tmp_path):
    """bench onebit_warmup: one record per run; during its warm-up a 1-bit run follows FSDP2's
    own gradients with int8 weights (w8-g-exact) exactly, and without one it does not."""
    stdout, recs = _run(tmp_path, "onebit_warmup", "--steps", "4", "--seeds", "1",
                        "--warmups", "0,2")
    by = {r["peer"]: r for r in recs}
    assert list(by) == ["exact", "w-exact-g8", "w8-g-exact", "q8", "q1-w0", "q1-w2"]
    for rec in recs:  # bench/records.py validates the curve fields of bench train only
        assert rec["bench"] == "onebit_warmup" and rec["op"] == "curve" and rec["ranks"] == 2
        assert rec["steps"] == 4 and len(rec["losses"]) == 4 and np.isfinite(rec["final_loss"])
    assert by["q1-w2"]["warmup"] == 2 and by["q8"]["warmup"] is None
    assert by["q1-w2"]["losses"][:3] == by["w8-g-exact"]["losses"][:3]
    assert by["q1-w0"]["losses"][1] != by["w8-g-exact"]["losses"][1]
    assert "final loss after 4 steps" in stdout
