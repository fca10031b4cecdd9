"""A benchmark declines what would not fit in memory: ``bench.memory``'s decision against a fake
MemAvailable (pure arithmetic, checked against a count done by hand), and ``bench ckpt
--simulate-ranks`` with a tiny fake MemAvailable printing its one-line decline of DCP's side while
its own planning still runs and prints."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import ckpt_sim_dcp as dcp
from bench import ckpt_simulate as cs
from bench import memory

TINY = "layers=2,hidden=24,heads=4,kv_heads=2,ffn=40,vocab=11"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _largest_by_counting(fixed: float, per: float, avail: int, safety: float) -> int:
    """The reference: count up until one more unit would not fit."""
    k = 0
    while safety * (fixed + per * (k + 1)) <= avail:
        k += 1
    return k


@pytest.mark.parametrize("avail", [0, 149, 150, 1000, 1234, 10 ** 6])
def test_memory_fit_against_counting(avail):
    fixed, per, units, safety = 100.0, 10.0, 50, 1.5
    fit = memory.memory_fit(fixed, per, units, safety, available_kib=avail)
    assert fit.need_kib == 900  # 1.5 x (100 + 10 x 50)
    assert fit.available_kib == avail
    assert fit.fits == (900 <= avail)
    assert fit.largest_fitting == _largest_by_counting(fixed, per, avail, safety)


def test_memory_fit_reads_mem_available_and_checks_its_input(monkeypatch):
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert 0 < memory.mem_available_kib() <= total
    monkeypatch.setattr(memory, "mem_available_kib", lambda: 2000)
    assert memory.memory_fit(0, 1000, 1).fits and not memory.memory_fit(0, 1000, 2).fits
    with pytest.raises(ValueError, match="safety >= 1"):
        memory.memory_fit(0, 1, 1, safety=0.5, available_kib=10)


def test_linear_fit():
    assert memory.linear_fit(2, 10, 6, 30) == (0.0, 5.0)
    assert memory.linear_fit(8, 100, 32, 100) == (100.0, 0.0)
    assert memory.linear_fit(8, 300, 32, 100) == (300.0, 0.0)  # memory kept from the larger run: no shrinking


def test_dcp_decline_note():
    est = dcp.Estimate(n=4096, fixed_kib=0, per_rank_kib=1024, linear_s=0.01, square_s=0.0, calibrated_at=(32, 8))
    assert dcp.decline(1000, est, 600, available_kib=16 << 20) is None  # 1.5 GiB of 16 GiB, 10 s
    note = dcp.decline(16384, est, 600, available_kib=16 << 20)  # 24 GiB needed
    assert note is not None and "\n" not in note
    assert "not run at 16384 ranks" in note and "24.0 GiB" in note and "16.0 GiB is available" in note
    assert "--simulate-ranks 10922 or fewer" in note  # 16 GiB / 1.5 / 1 MiB, rounded down
    assert "create_global_plan" not in note
    slow = dcp.Estimate(n=4096, fixed_kib=0, per_rank_kib=1, linear_s=0.0, square_s=1e-3, calibrated_at=(32, 8))
    note = dcp.decline(2000, slow, 600, available_kib=16 << 20, step=8)  # 4000 s estimated, 900 s allowed
    assert note is not None and "create_global_plan would take about 67 min" in note
    assert "--simulate-ranks 944 or fewer" in note  # sqrt(900 / 1e-3) = 948.7, a multiple of 8


def test_simulate_declines_dcp_and_still_prints_its_own(monkeypatch, capsys, tmp_path):
    out = tmp_path / "sim.json"
    monkeypatch.setattr(memory, "mem_available_kib", lambda: 1)
    assert cs.main(["--simulate-ranks", "40", "--model", TINY, "--load-ranks", "24", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "save rank      0:" in text and "root commit:" in text and "load rank     12 of 24:" in text
    lines = [line for line in text.splitlines() if "DCP" in line]
    assert len(lines) == 1 and lines[0].startswith("  DCP: not run at 40 ranks: it would hold about")
    assert "where 0 MiB is available" in lines[0] and "pass --dcp no" in lines[0]
    got = json.loads(out.read_text())
    assert got["dcp"]["finished"] is False and got["dcp"]["declined"].startswith("DCP: not run at 40 ranks")
    assert len(got["save"]) == 3 and len(got["load"]) == 3


def test_simulate_runs_dcp_where_it_fits(capsys):
    assert cs.main(["--simulate-ranks", "40", "--model", TINY, "--load-ranks", "24"]) == 0
    text = capsys.readouterr().out
    assert "DCP save: local plan" in text and "create_global_plan over 40 ranks" in text and "DCP load:" in text
    assert "not run" not in text


def test_bench_ckpt_declines_a_model_that_cannot_fit(tmp_path):
    """1,000 layers of Linear(10^6, 10^6): 10^15 parameters, no machine's memory; refused before
    any directory or tensor is made."""
    proc = subprocess.run([sys.executable, "-m", "bench", "ckpt", "--layers", "1000", "--hidden", "1000000",
                           "--save-ranks", "1", "--load-ranks", "1", "--deepspeed", "no", "--dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    n_params = 1000 * (10 ** 12 + 10 ** 6)
    need = 1.5 * n_params * (8 + 2 * 12) / 2 ** 30  # weights + gradients, and the fp32 Adam state twice
    assert (f"bench ckpt: not run: 1 ranks of --layers/--hidden's {n_params // 10 ** 6}M parameters would hold "
            f"at least {need:.1f} GiB") in proc.stderr, proc.stderr
    assert "pass a smaller --hidden or --layers" in proc.stderr
    assert list(tmp_path.iterdir()) == []
