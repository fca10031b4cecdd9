"""bench.common: size parsing, iteration schedule, bandwidth factors, records, table, JSON."""
from __future__ import annotations

import argparse
import io
import json

import pytest
from mpi4py import MPI

from bench import common


def test_parse_size_units():
    assert common.parse_size("8") == 8
    assert common.parse_size("1K") == 1024
    assert common.parse_size("64M") == 64 * 1024 * 1024
    assert common.parse_size("64MiB") == 64 * 1024 * 1024
    assert common.parse_size("2g") == 2 * 1024 ** 3
    with pytest.raises(ValueError, match="expected a size"):
        common.parse_size("12Q")


def test_parse_sizes_ranges_and_lists():
    sizes = common.parse_sizes("8:64M")
    assert sizes[0] == 8 and sizes[-1] == 64 << 20
    assert len(sizes) == 24  # 2^3 .. 2^26
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert common.parse_sizes("64M") == [64 << 20]
    assert common.parse_sizes("1K,8:32") == [1024, 8, 16, 32]
    with pytest.raises(ValueError, match="LO <= HI"):
        common.parse_sizes("1K:8")


def test_format_size_round_trips():
    for n in (8, 1000, 1024, 3 << 20, 64 << 20, 1 << 30):
        assert common.parse_size(common.format_size(n)) == n


def test_common_args():
    p = argparse.ArgumentParser()
    common.add_common_args(p)
    a = p.parse_args(["--sizes", "8:1K", "--iters", "5", "--json", "x.json"])
    assert a.sizes == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert (a.iters, a.warmup, a.json, a.plot, a.plot_y) == (5, None, "x.json", None, "busbw")
    with pytest.raises(SystemExit):
        p.parse_args(["--sizes", "nonsense"])


def test_iteration_schedule_osu_manner():
    small = common.iteration_schedule(8)
    mid = common.iteration_schedule(64 << 10)
    large = common.iteration_schedule(64 << 20)
    assert small[1] > mid[1] > large[1] >= common.MIN_ITERS
    assert common.iteration_schedule(64 << 20, iters=3, warmup=1) == (1, 3)
    assert common.iteration_schedule(8, iters=7) == (common.SMALL_WARMUP, 7)


@pytest.mark.parametrize("op,n,factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_gather", 4, 0.75),
    ("reduce_scatter", 2, 0.5), ("all_to_all", 8, 7 / 8), ("broadcast", 4, 1.0),
    ("all_reduce", 1, 0.0),
])
def test_busbw_factors_match_nccl_tests(op, n, factor):
    assert common.busbw_factor(op, n) == pytest.approx(factor)
    algbw, busbw = common.bandwidths(2_000_000, 0.001, op, n)
    assert algbw == pytest.approx(2.0)
    assert busbw == pytest.approx(2.0 * factor)


def test_busbw_unknown_op():
    with pytest.raises(ValueError, match="no bus bandwidth factor"):
        common.busbw_factor("scan", 2)


def _record(**over):
    info = {"ranks": 2, "hosts": 1, "network": "local"}
    rec = common.make_record(bench="collectives", op="all_reduce", dtype="float32", size_bytes=64,
                             info=info, times_s=(1e-6, 2e-6, 3e-6), algbw_gbps=0.1,
                             busbw_gbps=0.1, wire_bytes=64, wrong=0, peer="mpi4py")
    rec.update(over)
    return rec


def test_record_validation():
    rec = _record()
    assert common.validate_record(rec) == []
    assert rec["time_us_mean"] == pytest.approx(2.0)
    bad = _record(wrong=-1)
    del bad["size_bytes"]
    problems = common.validate_record(bad)
    assert any("size_bytes" in p for p in problems)
    assert any("'wrong'" in p for p in problems)
    assert common.validate_record(_record(ranks="2")) != []


def test_rounds_argument():
    p = argparse.ArgumentParser()
    common.add_rounds_arg(p)
    assert p.parse_args([]).rounds == 3
    assert p.parse_args(["--rounds", "5"]).rounds == 5
    with pytest.raises(SystemExit):
        p.parse_args(["--rounds", "0"])


def test_clean_env_drops_launcher_variables(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("MPICOMM_CHECK", "1")
    env = common.clean_env()
    assert "PMI_RANK" not in env and "OMPI_COMM_WORLD_SIZE" not in env
    assert env["MPICOMM_CHECK"] == "1"


def test_table_streams_rows():
    out = io.StringIO()
    t = common.Table(common.DEFAULT_COLUMNS, out=out)
    t.row(_record(count=16))
    t.row(_record(count=16, wrong=3))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("#") and "#wrong" in lines[0] and "busbw(GB/s)" in lines[0]
    assert len(lines) == 3
    assert lines[2].split()[-1] == "3"
    assert "all_reduce" in lines[1] and "mpi4py" in lines[1]


def test_json_writer_rewrites_after_each_record(tmp_path):
    path = tmp_path / "r.json"
    w = common.JsonWriter(str(path), {"bench": "x"})
    assert json.loads(path.read_text()) == {"meta": {"bench": "x"}, "records": []}
    w.add(_record())
    w.add(_record(op="broadcast"))
    doc = json.loads(path.read_text())
    assert [r["op"] for r in doc["records"]] == ["all_reduce", "broadcast"]


def test_header_lines_name_everything():
    info = common.environment_info(MPI.COMM_SELF)
    text = "\n".join(common.header_lines("collectives", info, dtype="float32",
                                         iterations="fixed"))
    assert all(line.startswith("#") for line in text.splitlines())
    for needle in ("collectives", info["mpi_vendor"], "mpi4py", "torch", "ranks: 1", "hosts: 1",
                   "float32", "iterations"):
        assert needle in text


def test_time_loop_counts_iterations():
    calls = []
    tmin, tmean, tmax = common.time_loop(lambda: calls.append(1), 7, 3, MPI.COMM_SELF)
    assert len(calls) == 10
    assert 0 <= tmin <= tmean <= tmax


def test_columns_take_measurement_columns_by_name():
    cols = common.columns("op", common.Column("x_fp32", "x_fp32", 8, ".3f"), "wrong")
    assert [c.heading for c in cols] == ["op", "x_fp32", "#wrong"]
    assert common.DEFAULT_COLUMNS[0] == common.columns("op")[0]


def test_narrative_reporter_prints_only_its_lines_and_writes_the_same_json(tmp_path):
    out = io.StringIO()
    args = argparse.Namespace(json=str(tmp_path / "d.json"))
    rep = common.Reporter("demo", MPI.COMM_SELF, args, out=out, narrative=True)
    rep.start(dtype="float32", iterations="see each part", meta={"parts": ["x"]})
    rep.line("== part ==")
    rep.emit(_record(wrong=2))
    rep.note("not printed")
    assert rep.finish() == 1 and rep.wrong == 2
    assert out.getvalue() == "== part ==\n"
    doc = json.loads((tmp_path / "d.json").read_text())
    assert doc["meta"]["bench"] == "demo" and doc["meta"]["parts"] == ["x"]
    assert [r["wrong"] for r in doc["records"]] == [2]
