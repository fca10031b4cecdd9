"""bench compressed: runs at every world size, checks its results, writes valid JSON records."""
from __future__ import annotations

import json

import pytest

from mpitest import check_all


@pytest.mark.mpi(min_size=1)
def test_bench_compressed_small_sizes(world, shared_tmp_path, capsys):
    from bench import common
    from bench import compressed as bench

    path = shared_tmp_path / "compressed.json"
    rc = bench.main(["--sizes", "1K,12K", "--iters", "3", "--warmup", "1", "--rounds", "1",
                     "--json", str(path)])

    def check():
        assert rc == 0
        if world.rank != 0:
            return
        out = capsys.readouterr().out
        assert out.startswith("# mpicomm benchmark: compressed")
        assert "1-bit/fp32 time" in out and "#wrong = 0" in out
        records = json.loads(path.read_text())["records"]
        assert [r["op"] for r in records[:6]] == ["all_reduce", "all_reduce:1bit", "compress",
                                                   "encode", "decompress", "memcpy"]
        assert len(records) == 12
        for rec in records:
            assert common.validate_record(rec) == [], rec
            assert rec["ranks"] == world.size and rec["wrong"] == 0
        one_bit = [r for r in records if r["op"] == "all_reduce:1bit"]
        fp32 = [r for r in records if r["op"] == "all_reduce"]
        if world.size > 1:
            assert all(f["wire_bytes"] >= 30 * b["wire_bytes"] for f, b in zip(fp32[1:], one_bit[1:]))

    check_all(check, world)


@pytest.mark.mpi(min_size=1)
def test_bench_compressed_opt_in_kernel_rows(world, shared_tmp_path):
    from bench import common
    from bench import compressed as bench

    path = shared_tmp_path / "kernels.json"
    rc = bench.main(["--sizes", "4K,40K", "--iters", "2", "--warmup", "1", "--rounds", "1",
                     "--ops", "server,compress:fused,memcpy", "--json", str(path)])

    def check():
        assert rc == 0
        if world.rank != 0:
            return
        records = json.loads(path.read_text())["records"]
        assert [(r["op"], r["size_bytes"]) for r in records] == [
            (op, size) for size in (4096, 40960) for op in ("compress:fused", "server", "memcpy")]
        for rec in records:
            assert common.validate_record(rec) == [], rec
            assert rec["peer"] == "local" and rec["wrong"] == 0

    check_all(check, world)


def test_bench_compressed_rejects_unknown_ops(capsys):
    from bench import compressed as bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--ops", "all_reduce,nonsense", "--sizes", "1K"])
    assert exc.value.code == 2
    assert "--ops: expected a comma list from all_reduce" in capsys.readouterr().err
