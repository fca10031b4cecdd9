"""bench collectives: check values against torch, measurements in process, the program end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from mpi4py import MPI
from mpitest import assert_all, mpiexec_cmd

from bench import collectives, common, values

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torch(host, name):
    t = torch.from_numpy(host.view(np.int16) if name == "bfloat16" else host)
    return t.view(torch.bfloat16) if name == "bfloat16" else t


def _host(t, name):
    return t.view(torch.int16).numpy().view(np.uint16) if name == "bfloat16" else t.numpy()


def _simulate(op, n, count, per_rank, name):
    """What every rank should hold: the send buffers moved around in torch; reductions summed in
    float32 (int64 for integers) and rounded once to the dtype."""
    sends = [_torch(values.send_values(op, r, count, per_rank, name), name) for r in range(n)]
    dt = sends[0].dtype
    if op in ("all_reduce", "reduce_scatter"):
        acc = torch.float32 if dt.is_floating_point and dt.itemsize <= 4 else (
            torch.float64 if dt.is_floating_point else torch.int64)
        total = torch.stack([s.to(acc) for s in sends]).sum(0).to(dt)
        if op == "all_reduce":
            return [total] * n
        return [total[r * per_rank:(r + 1) * per_rank] for r in range(n)]
    if op == "all_gather":
        return [torch.cat(sends)] * n
    if op == "all_to_all":
        return [torch.cat([s[r * per_rank:(r + 1) * per_rank] for s in sends]) for r in range(n)]
    return [sends[0]] * n  # broadcast from 0


@pytest.mark.parametrize("name", values.DTYPES)
@pytest.mark.parametrize("op", collectives.OPS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_expected_values_match_a_torch_simulation(op, n, name):
    itemsize = values.host_dtype(name).itemsize
    count, per_rank = collectives.counts_for(op, 200, itemsize, n)
    sim = _simulate(op, n, count, per_rank, name)
    for r in range(n):
        want = values.expected(op, r, n, count, per_rank, name)
        np.testing.assert_array_equal(want, _host(sim[r], name))


def test_bfloat16_rounding_matches_torch():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 1e3,
                        # exact ties between two bfloat16 values, both parities
                        ((np.arange(256, dtype=np.uint32) << 16) | 0x8000).view(np.float32),
                        np.array([np.inf, -np.inf, 0.0, -0.0, 3.4e38], np.float32)])
    got = values.bf16_bits(x)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(values.bf16_value(got),
                                  torch.from_numpy(x).to(torch.bfloat16).float().numpy())


@pytest.mark.parametrize("name", values.SIXTEEN_BIT)
def test_sixteen_bit_check_rejects_rounding_at_every_step(name):
    """At 3 ranks, a running 16-bit sum differs from the documented float32 sum rounded once."""
    n, count = 3, 84
    sends = [_torch(values.send_values("all_reduce", r, count, count, name), name) for r in range(n)]
    running = sends[0].clone()
    for s in sends[1:]:
        running = running + s
    want = values.expected("all_reduce", 0, n, count, count, name)
    assert values.count_wrong(_host(running, name), want, name) > 0
    assert values.count_wrong(_host(running, name), want, name, ulps=n - 1) == 0


def test_counts_round_to_a_multiple_of_ranks():
    assert collectives.counts_for("all_reduce", 8, 4, 3) == (2, 2)
    assert collectives.counts_for("all_gather", 8, 4, 3) == (3, 1)  # at least one per rank
    assert collectives.counts_for("reduce_scatter", 1024, 4, 3) == (255, 85)
    assert collectives.counts_for("all_to_all", 1024, 8, 4) == (128, 32)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", collectives.OPS)
def test_measure_size_in_process_is_correct(op):
    world = MPI.COMM_WORLD
    info = common.environment_info(world)
    peers, ctx, notes = collectives.available_peers(["mpicomm", "mpi4py"], world)
    assert_all(peers == ["mpicomm", "mpi4py"] and notes == [], f"{peers} {notes}")
    for name in ("float32", "bfloat16", "float16", "int32"):
        for size in (8, 4096):
            recs, notes = collectives.measure_size(peers, op, size, name, "cpu", world, info, ctx,
                                                   rounds=2, iters=2, warmup=1)
            assert_all([r["peer"] for r in recs] == peers and notes == [], f"{recs} {notes}")
            for rec in recs:
                assert_all(common.validate_record(rec) == [], f"{op} {name}: {rec}")
                assert_all(rec["wrong"] == 0, f"{op} {name} {size}: {rec}")
                assert_all(rec["rounds"] == 2 and len(rec["time_us_rounds"]) == 2 and
                           rec["iters"] == 2 and rec["device"] == "cpu", str(rec))
                assert_all(rec["time_us_mean"] in rec["time_us_rounds"], str(rec))


@pytest.mark.mpi(min_size=1)
def test_a_broken_collective_is_counted_wrong(monkeypatch):
    world = MPI.COMM_WORLD
    info = common.environment_info(world)
    real = collectives.make_case

    def broken(*args, **kwargs):
        case = real(*args, **kwargs)
        case.call = lambda: None  # the result never arrives
        return case

    monkeypatch.setattr(collectives, "make_case", broken)
    for name in ("float32", "bfloat16"):
        recs, _ = collectives.measure_size(["mpi4py"], "all_reduce", 64, name, "cpu", world,
                                           info, {}, rounds=1, iters=1, warmup=0)
        count = 64 // values.host_dtype(name).itemsize
        assert_all(recs[0]["wrong"] == count * world.Get_size(), f"{name}: {recs[0]['wrong']}")


def _run_program(n, tmp_path, *extra, timeout=240):
    out = tmp_path / f"coll{n}.json"
    launch = [*mpiexec_cmd(n), sys.executable, "-m", "mpi4py"] if n > 1 else \
        [sys.executable]
    cmd = [*launch, "-m", "bench", "collectives", "--sizes", "8,1K", "--iters", "2",
           "--warmup", "1", "--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc, json.loads(out.read_text())


@pytest.mark.parametrize("n", [1, 2])
def test_program_runs_and_json_validates(n, tmp_path):
    proc, doc = _run_program(n, tmp_path, "--dtype", "float32", "bfloat16,int32", "--device",
                             "cpu", "cuda", "--rounds", "2")
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# mpicomm benchmark: collectives")
    assert any("#wrong" in line and "time(us)" in line for line in lines)
    assert "all values correct" in proc.stdout
    if not torch.cuda.is_available():
        assert "# cuda rows skipped: no CUDA device here" in proc.stdout
    recs = doc["records"]
    assert doc["meta"]["ranks"] == n
    peers = {r["peer"] for r in recs}
    assert peers == set(collectives.PEERS) == {"mpicomm", "mpicomm-pg", "mpi4py", "gloo"}
    assert {r["op"] for r in recs} == set(collectives.OPS)
    assert {r["dtype"] for r in recs} == {"float32", "bfloat16", "int32"}
    devices = {"cpu", "cuda"} if torch.cuda.is_available() else {"cpu"}
    assert {r["device"] for r in recs} == devices
    assert len(recs) == len(collectives.OPS) * 3 * len(devices) * 2 * 4 - (
        len(collectives.OPS) * 3 * 2 if "cuda" in devices else 0)  # no mpi4py rows on cuda
    for rec in recs:
        assert common.validate_record(rec) == [], rec
        assert rec["ranks"] == n and rec["wrong"] == 0 and rec["rounds"] == 2
    # table rows carry the same numbers as the records, streamed in the same order
    rows = [line.split() for line in lines if line and not line.startswith("#")]
    assert [(r[0], r[1], int(r[2]), r[4], r[5], float(r[6])) for r in rows] == [
        (r["op"], r["peer"], r["size_bytes"], r["dtype"], r["device"],
         round(r["time_us_mean"], 1)) for r in recs]
    # the summary ratios are the medians' ratios
    summary = next(line for line in lines if line.startswith("# all_reduce float32 cpu 1K:"))
    at = {r["peer"]: r for r in recs if (r["op"], r["dtype"], r["size_bytes"]) ==
          ("all_reduce", "float32", 1024)}
    ratio = at["mpicomm"]["time_us_mean"] / at["mpi4py"]["time_us_mean"]
    assert f"= {ratio:.2f}x mpi4py" in summary


@pytest.mark.parametrize("n", [1, 2])
def test_unwritable_json_stops_every_rank(n, tmp_path):
    launch = [*mpiexec_cmd(n), sys.executable, "-m", "mpi4py"] if n > 1 else [sys.executable]
    proc = subprocess.run([*launch, "-m", "bench", "collectives", "--sizes", "8", "--json",
                           str(tmp_path / "no" / "such" / "dir.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("bench collectives: cannot write --json") == 1, proc.stderr


def test_program_rejects_bad_arguments():
    for bad in (["--ops", "scan"], ["--dtype", "float8"], ["--device", "tpu"], ["--rounds", "0"]):
        proc = subprocess.run([sys.executable, "-m", "bench", "collectives", *bad], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, bad
        assert "expected" in proc.stderr, proc.stderr


@pytest.mark.mpi(min_size=1)
def test_program_exits_non_zero_on_wrong_values(monkeypatch, capsys):
    real = collectives.make_case

    def broken(*args, **kwargs):
        case = real(*args, **kwargs)
        case.call = lambda: None
        return case

    monkeypatch.setattr(collectives, "make_case", broken)
    rc = collectives.main(["--ops", "all_reduce", "--peers", "mpi4py", "--sizes", "64",
                           "--iters", "1", "--warmup", "0", "--rounds", "1"])
    out = capsys.readouterr().out
    assert_all(rc == 1, f"exit code {rc}")
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert_all("FAILED: " in out, out)
    else:
        assert_all(True)
