"""bench train: DDP peers side by side at 1 and 2 ranks (small sizes), loss curves, wrong replicas."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mpi4py import MPI

from bench import common, plot, train, train_curve
from mpitest import assert_all, mpiexec_cmd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--hidden", "32", "--layers", "2", "--batch", "4", "--steps", "2", "--warmup", "2",
         "--rounds", "2"]


def _run(n, tmp_path, *args, timeout=300):
    out = tmp_path / f"train{n}.json"
    launch = [*mpiexec_cmd(n), sys.executable, "-m", "mpi4py"] if n > 1 else [sys.executable]
    proc = subprocess.run([*launch, "-m", "bench", "train", *args, "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.parametrize("n,model", [pytest.param(1, "mlp", marks=pytest.mark.slow), (2, "mlp"),
                                     pytest.param(2, "transformer", marks=pytest.mark.slow)])
def test_peers_side_by_side(n, model, tmp_path):
    extra = ["--heads", "2", "--seq", "4"] if model == "transformer" else []
    stdout, doc = _run(n, tmp_path, *SMALL, "--model", model, *extra)
    recs = doc["records"]
    assert [r["peer"] for r in recs] == list(train.PEERS)
    for rec in recs:
        assert common.validate_record(rec) == [], rec
        assert rec["ranks"] == n and rec["wrong"] == 0 and rec["rounds"] == 2
        assert rec["trained_steps"] == 2 + 2 * 2 and rec["model"].startswith(model)
        assert rec["samples_per_s"] == pytest.approx(4 * n / (rec["step_ms"] / 1e3))
    loss = {r["peer"]: r["loss"] for r in recs}
    for peer in ("mpicomm", "mpicomm-hook"):  # the same training as gloo's
        assert loss[peer] == pytest.approx(loss["gloo"], rel=1e-4)
    if n == 1:  # no one to exchange with: 1-bit is the identity
        assert loss["onebit-hook"] == pytest.approx(loss["gloo"], rel=1e-4)
    assert "step time / gloo's (medians): mpicomm " in stdout
    assert "all values correct" in stdout and "overlap" in stdout


def test_bfloat16_ddp_and_fsdp2_rows(tmp_path):
    """--dtype bfloat16: DDP on bf16 gradients; FSDP2 rows with bf16 and fp32 reductions, each
    checked against its gloo twin (2 ranks: 16-bit sums of two values round alike)."""
    stdout, doc = _run(2, tmp_path, *SMALL, "--dtype", "bfloat16", "--peers",
                       "mpicomm,gloo,fsdp2-mpicomm-r32,fsdp2-gloo-r32,fsdp2-mpicomm-r16,"
                       "fsdp2-gloo-r16")
    recs = {r["peer"]: r for r in doc["records"]}
    for rec in recs.values():
        assert common.validate_record(rec) == [], rec
        assert rec["wrong"] == 0 and rec["dtype"] == "bfloat16"
    assert recs["mpicomm"]["grad_dtype"] == "bfloat16"
    assert recs["fsdp2-mpicomm-r32"]["grad_dtype"] == "float32"
    for name in ("mpicomm", "fsdp2-mpicomm-r32", "fsdp2-mpicomm-r16"):
        twin = train.reference_of(name)
        assert recs[name]["loss"] == pytest.approx(recs[twin]["loss"], rel=1e-3), name
    assert "fsdp2-mpicomm-r16 " in stdout and "(fsdp2-gloo-r16's)" in stdout


def test_parts_split_the_fsdp2_step(tmp_path):
    """--parts: every FSDP2 step splits into compute and collective time (they add up to the
    step); FSDP2's own collectives run no int8 kernel, the quantized ones do."""
    stdout, doc = _run(2, tmp_path, *SMALL, "--parts", "--peers",
                       "fsdp2-mpicomm-r16,fsdp2-mpicomm-q8")
    recs = {r["peer"]: r for r in doc["records"]}
    for rec in recs.values():
        assert common.validate_record(rec) == [], rec
        assert rec["compute_ms"] + rec["coll_ms"] == pytest.approx(rec["step_ms"], rel=1e-6)
        assert rec["pack_ms"] + rec["wire_ms"] + rec["unpack_ms"] == pytest.approx(rec["coll_ms"])
        assert 0 < rec["coll_ms"] < rec["step_ms"] and rec["wire_ms"] > 0
    assert recs["fsdp2-mpicomm-r16"]["pack_ms"] == recs["fsdp2-mpicomm-r16"]["unpack_ms"] == 0
    assert recs["fsdp2-mpicomm-q8"]["pack_ms"] > 0 and recs["fsdp2-mpicomm-q8"]["unpack_ms"] > 0
    assert "step parts per step" in stdout and "fsdp2-mpicomm-q8: compute " in stdout
    bad = dict(recs["fsdp2-mpicomm-q8"], pack_ms=-1.0)
    assert any("pack_ms" in p for p in common.validate_record(bad))


@pytest.mark.parametrize("n", [1, 2])
def test_curve(n, tmp_path):
    png = tmp_path / "curve.png"
    stdout, doc = _run(n, tmp_path, "--hidden", "32", "--layers", "2", "--batch", "4", "--curve",
                       "--curve-steps", "8", "--freeze-step", "3", "--plot", str(png))
    recs = {r["peer"]: r for r in doc["records"]}
    assert list(recs) == list(train_curve.CURVES)
    for rec in recs.values():
        assert common.validate_record(rec) == [], rec
        assert rec["op"] == "curve" and rec["steps"] == 8 and rec["wrong"] == 0
        assert rec["step_ms"] > 0 and rec["label"].startswith(rec["peer"])
    adam, onebit = recs["adam"]["losses"], recs["onebit-adam"]["losses"]
    # exact Adam (and LAMB) up to the freeze step: the same losses
    assert onebit[:4] == pytest.approx(adam[:4], rel=1e-5)
    assert recs["zero-one-adam"]["losses"][:4] == pytest.approx(adam[:4], rel=1e-5)
    assert recs["onebit-lamb"]["losses"][:4] == pytest.approx(recs["lamb"]["losses"][:4], rel=1e-5)
    assert adam[-1] < adam[0]
    sent = {k: r["bytes_per_step"] for k, r in recs.items()}
    if n == 1:
        assert set(sent.values()) == {0}
    else:   # compressed rounds (and 0/1 Adam's skipped ones) show
        assert sent["adam"] == sent["lamb"] > sent["onebit-adam"] > 0 and sent["onebit-lamb"] > 0
        assert 0 < sent["zero-one-adam"] < sent["adam"]
    assert "# loss after 8 steps: Adam" in stdout and "all losses finite" in stdout
    if plot.matplotlib_missing() is None:
        assert png.read_bytes()[:4] == b"\x89PNG"
        out = tmp_path / "again.png"
        proc = subprocess.run([sys.executable, "-m", "bench", "plot", str(tmp_path / f"train{n}.json"),
                               "-o", str(out)], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0 and out.read_bytes()[:4] == b"\x89PNG", proc.stderr


def test_bad_arguments():
    for bad in (["--peers", "nccl"], ["--hidden", "4"], ["--steps", "0"], ["--rounds", "0"]):
        proc = subprocess.run([sys.executable, "-m", "bench", "train", *bad], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "expected" in proc.stderr, (bad, proc.stderr)


@pytest.mark.mpi(min_size=1)
def test_a_replica_off_the_reference_is_counted_wrong(monkeypatch, capsys):
    import torch

    real = train.make_peer

    def off(name, *args, **kwargs):
        peer = real(name, *args, **kwargs)
        if name == "mpicomm-hook":
            with torch.no_grad():
                next(peer.ddp.module.parameters()).add_(1e-2)
        return peer

    monkeypatch.setattr(train, "make_peer", off)
    rc = train.main([*SMALL, "--rounds", "1", "--peers", "gloo,mpicomm-hook"])
    out = capsys.readouterr().out
    assert_all(rc == 1, f"exit code {rc}")
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert_all("FAILED: " in out, out)
    else:
        assert_all(True)
