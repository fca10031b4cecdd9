"""bench collectives: reference values, one measurement per op in process, and the program end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import assert_all, mpiexec_cmd

from bench import collectives, common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _simulate(op, n, count, per_rank, dtype):
    """What every rank should hold, by moving the send buffers around in plain numpy."""
    sends = [collectives.send_values(op, r, count, per_rank, dtype) for r in range(n)]
    if op == "all_reduce":
        return [np.sum(sends, axis=0)] * n
    if op == "all_gather":
        return [np.concatenate(sends)] * n
    if op == "reduce_scatter":
        total = np.sum(sends, axis=0)
        return [total[r * per_rank:(r + 1) * per_rank] for r in range(n)]
    if op == "all_to_all":
        return [np.concatenate([s[r * per_rank:(r + 1) * per_rank] for s in sends])
                for r in range(n)]
    return [sends[0]] * n  # broadcast from 0


@pytest.mark.parametrize("op", collectives.OPS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_expected_values_match_a_simulation(op, n):
    count, per_rank = collectives.counts_for(op, 100, 4, n)
    sim = _simulate(op, n, count, per_rank, np.float32)
    for r in range(n):
        np.testing.assert_array_equal(
            collectives.expected(op, r, n, count, per_rank, np.float32), sim[r])


def test_counts_round_to_a_multiple_of_ranks():
    assert collectives.counts_for("all_reduce", 8, 4, 3) == (2, 2)
    assert collectives.counts_for("all_gather", 8, 4, 3) == (3, 1)  # at least one per rank
    assert collectives.counts_for("reduce_scatter", 1024, 4, 3) == (255, 85)
    assert collectives.counts_for("all_to_all", 1024, 8, 4) == (128, 32)


def _mpicomm_ready() -> bool:
    import mpicomm

    return hasattr(mpicomm.init(), "all_reduce")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", collectives.OPS)
def test_measure_in_process_is_correct(op):
    world = MPI.COMM_WORLD
    info = common.environment_info(world)
    peers = ["mpi4py"]
    ctx = {}
    if _mpicomm_ready():
        import mpicomm

        peers.append("mpicomm")
        ctx["mpicomm"] = mpicomm.init()
    for peer in peers:
        for size in (8, 4096):
            rec = collectives.measure(peer, op, size, "float32", world, info, ctx, iters=3,
                                      warmup=1)
            assert_all(common.validate_record(rec) == [], f"{peer} {op}: {rec}")
            assert_all(rec["wrong"] == 0, f"{peer} {op} {size}: {rec['wrong']} wrong values")
            assert_all(rec["ranks"] == world.Get_size() and rec["iters"] == 3, str(rec))


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
    rec = collectives.measure("mpi4py", "all_reduce", 64, "float32", world, info, {}, iters=1,
                              warmup=0)
    assert_all(rec["wrong"] == 16 * world.Get_size(), f"wrong = {rec['wrong']}")


def _run_program(n, tmp_path, *extra, timeout=180):
    out = tmp_path / f"coll{n}.json"
    cmd = [*mpiexec_cmd(n), sys.executable, "-m", "mpi4py", "-m", "bench", "collectives",
           "--sizes", "8:1K", "--iters", "3", "--warmup", "1", "--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc, json.loads(out.read_text())


@pytest.mark.parametrize("n", [1, 2])
def test_program_runs_and_json_validates(n, tmp_path):
    proc, doc = _run_program(n, tmp_path)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# mpicomm benchmark: collectives")
    assert any("#wrong" in line for line in lines)
    assert "all values correct" in proc.stdout
    recs = doc["records"]
    assert doc["meta"]["ranks"] == n
    peers = {r["peer"] for r in recs}
    assert {"mpi4py", "gloo"} <= peers
    assert {r["op"] for r in recs} == set(collectives.OPS)
    assert len(recs) == len(collectives.OPS) * 8 * len(peers)
    for rec in recs:
        assert common.validate_record(rec) == [], rec
        assert rec["ranks"] == n and rec["wrong"] == 0
        assert rec["time_us_min"] <= rec["time_us_mean"] <= rec["time_us_max"]
    # table rows carry the same numbers as the records, streamed in the same order
    rows = [line.split() for line in lines if line and not line.startswith("#")]
    assert [(r[0], r[1], int(r[2])) for r in rows] == [
        (r["op"], r["peer"], r["size_bytes"]) for r in recs]


def test_program_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "bench", "collectives", "--ops", "scan"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "expected a comma list" in proc.stderr


@pytest.mark.mpi(min_size=1)
def test_program_exits_non_zero_on_wrong_values(monkeypatch, capsys):
    real = collectives.make_case

    def broken(*args, **kwargs):
        case = real(*args, **kwargs)
        case.call = lambda: None
        return case

    monkeypatch.setattr(collectives, "make_case", broken)
    rc = collectives.main(["--ops", "all_reduce", "--peers", "mpi4py", "--sizes", "64",
                           "--iters", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    assert_all(rc == 1, f"exit code {rc}")
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert_all("FAILED: " in out, out)
    else:
        assert_all(True)
