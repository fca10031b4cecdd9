"""bench compressed --crossover: the crossover rule, verdict lines, JSON and plot (tiny sizes, no netsim)."""
from __future__ import annotations

import json

import pytest

from bench import crossover
from bench.records import validate_record
from mpitest import check_all


def test_crossover_is_the_smallest_size_from_which_one_bit_stays_faster():
    sizes = [1, 2, 4, 8, 16]
    assert crossover.crossover(sizes, [5, 5, 5, 5, 5], [9, 4, 6, 4, 3]) == 8  # a dip at 2 is noise
    assert crossover.crossover(sizes, [5] * 5, [1] * 5) == 1
    assert crossover.crossover(sizes, [5] * 5, [1, 1, 1, 1, 6]) is None  # slower at the largest
    assert crossover.crossover([16, 1, 4, 2, 8], [5] * 5, [3, 9, 6, 4, 4]) == 8  # any order


def test_summary_lines_per_setting_and_api():
    recs = [{"setting": "netsim 1gbit", "op": op, "size_bytes": s, "time_us_mean": t}
            for op, times in (("all_reduce", (10, 100)), ("all_reduce:1bit", (20, 50)),
                              ("all_reduce:1bit-ar", (30, 200)))
            for s, t in zip((1024, 1 << 20), times)]
    res = crossover.summarize(recs)
    assert [(r["api"], r["crossover_bytes"]) for r in res] == [("MpiBackend", 1 << 20),
                                                              ("OnebitAllreduce", None)]
    assert crossover.lines(res) == [
        "crossover: 1-bit faster from 1048576 bytes at netsim 1gbit [MpiBackend]",
        "crossover: 1-bit never faster (up to 1048576 bytes) at netsim 1gbit [OnebitAllreduce]"]


@pytest.mark.mpi(min_size=2)
def test_crossover_run_here_writes_json_and_plot(world, shared_tmp_path, capsys):
    from bench import compressed as bench

    js, png = shared_tmp_path / "x.json", shared_tmp_path / "x.png"
    rc = bench.main(["--crossover", "--sizes", "1K,8K", "--rates", "1gbit", "--iters", "2",
                     "--warmup", "1", "--json", str(js), "--plot", str(png)])

    def check():
        assert rc == 0
        if world.rank != 0:
            return
        out = capsys.readouterr().out
        verdicts = [line for line in out.splitlines() if line.startswith("crossover: 1-bit ")]
        assert len(verdicts) == 2 and all(" at local [" in v for v in verdicts), out
        assert "netsim rates skipped: under mpiexec" in out
        doc = json.loads(js.read_text())
        results = [r for r in doc["records"] if r["op"] == "crossover"]
        measured = [r for r in doc["records"] if r["op"] != "crossover"]
        assert [r["api"] for r in results] == ["MpiBackend", "OnebitAllreduce"]
        assert all(r["sizes"] == [1024, 8192] for r in results)
        assert {r["op"] for r in measured} == set(crossover.OPS)
        assert all(r["wrong"] == 0 for r in doc["records"])
        # one Reporter's file: the meta envelope, every record valid
        assert doc["meta"]["bench"] == "compressed" and doc["meta"]["ranks"] == world.size
        assert all(validate_record(r) == [] for r in doc["records"]), doc["records"]
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # bench plot draws the same panels from the file
        from bench import plot

        again = shared_tmp_path / "again.png"
        assert plot.main([str(js), "-o", str(again)]) == 0
        assert again.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    check_all(check, world)


def test_crossover_rejects_bad_rates(capsys):
    from bench import compressed as bench

    assert bench.main(["--crossover", "--rates", "fast"]) == 2
    assert "expected a rate" in capsys.readouterr().err
