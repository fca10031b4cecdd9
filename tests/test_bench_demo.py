"""bench demo: each part at small sizes, the JSON it writes, and its one-line notes when a part cannot run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mpi4py import MPI

from bench import common, demo, netsim
from mpitest import assert_all, mpiexec_cmd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _demo(n, tmp_path, *args, timeout=240):
    out = tmp_path / f"demo{n}.json"
    launch = [*mpiexec_cmd(n), sys.executable, "-m", "mpi4py"] if n > 1 else [sys.executable]
    proc = subprocess.run([*launch, "-m", "bench", "demo", *args, "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.parametrize("n", [1, 2])
def test_demo_collectives_and_compressed_parts(n, tmp_path):
    stdout, doc = _demo(n, tmp_path, "--parts", "collectives,compressed", "--sizes", "4K",
                        "--compressed-size", "256K", "--budget", "0.05")
    assert "== 1. Collectives" in stdout and "== 2. Compressed" in stdout
    assert "all values correct" in stdout
    assert "== Summary ==" in stdout and "all_reduce 4K, local: mpicomm" in stdout
    recs = doc["records"]
    assert recs and all(common.validate_record(r) == [] for r in recs)
    assert all(r["ranks"] == n and r["wrong"] == 0 for r in recs)
    peers = {r["peer"] for r in recs}
    assert {"mpi4py", "gloo"} <= peers
    assert any(p.startswith("fp32-") for p in peers)
    # the 1-bit row is always there: a compressed package that fails to import fails the demo
    assert "onebit" in peers and "1-bit compressed allreduce (compressed.OnebitAllreduce)" in stdout
    assert all(r["rounds"] == 3 for r in recs)  # every peer measured in interleaved rounds


def test_demo_rejects_unknown_parts():
    proc = subprocess.run([sys.executable, "-m", "bench", "demo", "--parts", "everything"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--parts: expected a comma list from collectives" in proc.stderr, \
        proc.stderr


@pytest.mark.mpi(min_size=1)
def test_network_part_says_why_it_is_skipped(monkeypatch):
    monkeypatch.setattr(netsim, "preflight", lambda: "netsim needs root (on purpose)")
    lines: list[str] = []
    recs = demo.part_network(MPI.COMM_WORLD, lines.append, ["1gbit"], 1 << 20, timeout_s=10)
    assert_all(recs == [], f"records {recs}")
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert_all(any("skipped: netsim needs root (on purpose)" in x for x in lines), str(lines))
    else:
        assert_all(True)


def test_demo_fails_when_compressed_does_not_import():
    """A compressed package that does not import is an error, not a skipped part."""
    code = ("import sys; sys.modules['compressed'] = None; from bench.__main__ import main; "
            "sys.exit(main(['demo', '--parts', 'compressed', '--compressed-size', '4K']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "ModuleNotFoundError" in proc.stderr and "compressed" in proc.stderr, proc.stderr


def _netsim_ready():
    if netsim.preflight() is not None:
        return False
    probe = f"mpicomm-{os.getpid()}-probe"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return False
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _netsim_ready(), reason="needs root, ip, tc, unshare and network namespaces")
def test_demo_network_part(tmp_path):
    before = set(netsim.leftovers("mpicomm-"))
    stdout, doc = _demo(1, tmp_path, "--parts", "network", "--compressed-size", "1M",
                        "--rates", "1gbit")
    assert "== 3. Simulated network" in stdout and "[1gbit] fp32 allreduce" in stdout
    recs = doc["records"]
    assert recs and all(r["hosts"] == 2 and "netsim" in r["network"] for r in recs)
    assert all(common.validate_record(r) == [] for r in recs)
    # whatever appeared and belongs to a finished process was left behind by the demo's netsim
    new = set(netsim.leftovers("mpicomm-")) - before
    left = [x for x in new if not netsim._pid_alive(int(x.split("mpicomm-")[1].split("-")[0]))]
    assert left == []
