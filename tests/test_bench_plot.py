"""bench plot: saved runs drawn log-log with bands; --plot; a missing matplotlib is one message."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import plot, records
from mpitest import mpiexec_cmd

pytestmark = pytest.mark.once    # the same on any MPI: CI runs it on MPICH only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDE = "import sys; sys.modules['matplotlib'] = None; "


def _rec(op, peer, size, t_us, dtype="float32", lo=None, hi=None):
    info = {"ranks": 2, "hosts": 1, "network": "local"}
    rounds = [t_us * 1e-6, (lo or t_us) * 1e-6, (hi or t_us) * 1e-6]
    return records.make_record(bench="collectives", op=op, dtype=dtype, size_bytes=size,
                               info=info, times_s=(t_us * 1e-6,) * 3,
                               algbw_gbps=size / t_us / 1e3, busbw_gbps=size / t_us / 1e3,
                               wire_bytes=size, wrong=0, round_means_s=rounds, peer=peer,
                               device="cpu")


def _run_file(path, scale=1.0):
    recs = [_rec(op, peer, s, scale * (10 + s / 1e3) * (2 if peer == "gloo" else 1),
                 lo=scale * (8 + s / 1e3), hi=scale * (30 + s / 1e3))
            for op in ("all_reduce", "broadcast") for peer in ("mpicomm", "gloo")
            for s in (8, 1024, 1 << 20)]
    path.write_text(json.dumps({"meta": {"ranks": 2, "network": "local"}, "records": recs}))
    return recs


def test_size_labels():
    assert [plot.size_label(n) for n in (8, 512, 1024, 1536, 64 << 20, 1 << 30)] == [
        "8 B", "512 B", "1 KiB", "1.5 KiB", "64 MiB", "1 GiB"]


@pytest.mark.skipif(plot.matplotlib_missing() is not None, reason="needs matplotlib")
def test_figure_is_log_log_with_size_ticks_bands_and_one_panel_per_op(tmp_path):
    recs = _run_file(tmp_path / "a.json") + [
        dict(r, run="b") for r in _run_file(tmp_path / "b.json", scale=2.0)]
    fig = plot.draw_records(recs, y="time")
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["all_reduce", "broadcast"]
    for ax in axes:
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert labels == ["32 B", "1 KiB", "32 KiB", "1 MiB"], labels
        assert len(ax.lines) == 4 and len(ax.collections) == 4  # 2 peers x 2 runs, each banded
        # the band spans the fastest and slowest round
        band = ax.collections[0].get_paths()[0].vertices[:, 1]
        assert band.min() == pytest.approx(8.008) and band.max() == pytest.approx(30 + 1048.576)
        colours = {line.get_color() for line in ax.lines}
        markers = {line.get_marker() for line in ax.lines}
        assert len(colours) == 2 and len(markers) == 2  # peers by colour, runs by marker
    legend_titles = [lg.get_title().get_text() for lg in fig.legends]
    assert legend_titles == ["peer (colour)", "run (marker)"]
    import matplotlib.pyplot as plt

    plt.close(fig)


@pytest.mark.skipif(plot.matplotlib_missing() is not None, reason="needs matplotlib")
def test_bandwidth_band_is_inverse_of_time():
    rec = _rec("all_reduce", "mpicomm", 1 << 20, 100.0, lo=50.0, hi=200.0)
    lo, hi = plot._band(rec, "algbw_gbps")
    assert lo == pytest.approx(rec["algbw_gbps"] / 2) and hi == pytest.approx(rec["algbw_gbps"] * 2)


def test_plot_command_on_saved_runs(tmp_path):
    _run_file(tmp_path / "a.json")
    _run_file(tmp_path / "b.json", scale=3.0)
    out = tmp_path / "out.png"
    for y in ("busbw", "algbw", "time"):
        proc = subprocess.run([sys.executable, "-m", "bench", "plot", str(tmp_path / "a.json"),
                               str(tmp_path / "b.json"), "-o", str(out), "--y", y], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        if plot.matplotlib_missing():
            assert proc.returncode == 2 and "pip install matplotlib" in proc.stderr
            return
        assert proc.returncode == 0, proc.stderr
        assert "24 records from 2 run(s)" in proc.stdout
        assert out.read_bytes()[:4] == b"\x89PNG"


def test_plot_command_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"records": 3}')
    for args, needle in ((["missing.json"], "cannot read missing.json"),
                         ([str(bad)], "expected a bench JSON file")):
        proc = subprocess.run([sys.executable, "-m", "bench", "plot", *args, "-o",
                               str(tmp_path / "x.png")], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


def test_plot_command_without_matplotlib(tmp_path):
    _run_file(tmp_path / "a.json")
    code = HIDE + ("from bench.__main__ import main; "
                   f"sys.exit(main(['plot', {str(tmp_path / 'a.json')!r}, '-o', 'x.png']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "bench plot: plots need matplotlib, which is not installed: pip install matplotlib "
        "(or the 'plot' extra: pip install 'mpicomm[plot]')"]


@pytest.mark.parametrize("n", [1, 2])
def test_program_plot_option_without_matplotlib_still_measures(n, tmp_path):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    code = HIDE + ("from bench.collectives import main; sys.exit(main(['--ops', 'all_reduce', "
                   "'--sizes', '8', '--iters', '1', '--warmup', '0', '--rounds', '1', "
                   f"'--json', {str(out)!r}, '--plot', {str(png)!r}]))")
    launch = [*mpiexec_cmd(n), sys.executable, "-m", "mpi4py"] if n > 1 else \
        [sys.executable]
    proc = subprocess.run([*launch, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("skipped: plots need matplotlib") == 1, proc.stdout
    assert not png.exists() and json.loads(out.read_text())["records"]


@pytest.mark.skipif(plot.matplotlib_missing() is not None, reason="needs matplotlib")
def test_program_plot_option_draws(tmp_path):
    png = tmp_path / "c.png"
    proc = subprocess.run([*mpiexec_cmd(2), sys.executable, "-m", "mpi4py", "-m",
                           "bench", "collectives", "--ops", "all_reduce,broadcast", "--sizes",
                           "8:64", "--iters", "1", "--warmup", "0", "--rounds", "2", "--plot",
                           str(png), "--plot-y", "time"], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"plot written to {png}" in proc.stdout and png.read_bytes()[:4] == b"\x89PNG"
