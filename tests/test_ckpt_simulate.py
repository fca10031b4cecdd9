"""``bench ckpt --simulate-ranks``: the plans it makes for N simulated ranks are a real job's (1-4
ranks, run here under mpiexec; FSDP2, FSDP2 x TP on a 2x2 mesh, ZeroOptimizer stage 1 at 2
ranks), match torch.chunk's shards for N up to 1,000, and a rank's planning work grows linearly
with the tensors it holds and not with N."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bench import ckpt_simulate as cs
from mpitest import mpiexec_cmd

pytestmark = pytest.mark.once    # the same on any MPI: CI runs it on MPICH only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "ckpt_simulate_job.py")
TINY = "layers=2,hidden=24,heads=4,kv_heads=2,ffn=40,vocab=11"
BLOCK, CHUNK = 4096, 8192


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _real_and_sim(tmp_path, layout: str, k: int) -> tuple[dict, dict]:
    real, sim = tmp_path / "real.json", tmp_path / "sim.json"
    subprocess.run(mpiexec_cmd(k) + [sys.executable, JOB, "real", layout, str(real)], check=True, timeout=300,
                   env=_env(), cwd=ROOT)
    subprocess.run([sys.executable, JOB, "sim", layout, str(k), str(sim)], check=True, timeout=300, env=_env(),
                   cwd=ROOT)
    return json.loads(real.read_text()), json.loads(sim.read_text())


@pytest.mark.parametrize("layout,k", [pytest.param("fsdp2", 1, marks=pytest.mark.slow), ("fsdp2", 2),
                                      pytest.param("fsdp2", 3, marks=pytest.mark.slow),
                                      pytest.param("fsdp2", 4, marks=pytest.mark.slow),
                                      pytest.param("fsdp2-tp", 4, marks=pytest.mark.slow),
                                      pytest.param("zero1", 2, marks=pytest.mark.slow)])
def test_simulated_plans_are_a_real_jobs(tmp_path, layout, k):
    """A real job of k ranks (FSDP2 + AdamW; FSDP2 over torch's tensor parallel on a (k/2, 2)
    mesh; a replicated model + ZeroOptimizer(AdamW, stage=1)) saves (ckpt.save) and plans its save
    and load; the simulation of k ranks gives the same manifest entries (layout rules included)
    and the same byte ranges per rank."""
    a, b = _real_and_sim(tmp_path, layout, k)
    assert a["manifest"] == b["manifest"]  # the manifest ckpt.save wrote (its tensors, file size, params)
    assert a["planned"] == b["manifest"]
    assert a["save"] == b["save"] and len(a["save"]) == k
    assert a["load"] == b["load"]
    if layout == "fsdp2-tp":  # the real job's layouts are the 2-D ones (not FSDP's alone)
        kinds = {t["name"].split(".")[-2]: t["layout"]["placements"] for t in a["manifest"][0]}
        assert kinds["q_proj"] == [["strided", 0, 2], ["shard", 0]]
        assert kinds["down_proj"] == [["shard", 0], ["shard", 1]]
        assert kinds["input_layernorm"] == [["shard", 0], ["replicate"]]


def _chunk_rows(rows: int, n: int, r: int) -> tuple[int, int]:
    """torch.chunk's piece r of n over rows (empty past the last piece): the reference."""
    pieces = torch.arange(rows).chunk(n)
    if r >= len(pieces):
        return rows, rows
    return int(pieces[r][0]), int(pieces[r][-1]) + 1


@pytest.mark.parametrize("n", [1, 3, 64, 1000])
def test_simulated_writes_are_torch_chunk_shards(n):
    shapes = cs.llama_shapes(cs.parse_model(TINY))
    ranks = range(n) if n <= 3 else sorted({*cs.sample_ranks(n), 1, n // 3})
    covered = []
    for r in ranks:
        res = cs.ckpt_save_rank(r, n, shapes, "fsdp2", 8, BLOCK, CHUNK, memory=False)
        m = res["manifest"]
        start = min(e.offset for e in m.tensors)  # the safetensors header before: replicated, shared out
        own = sorted((it.offset, it.nbytes) for it in res["items"] if it.offset >= start)
        want = []
        for e in m.tensors:
            assert e.layout == {"mesh": [n], "placements": [["shard", 0]]}
            row = e.nbytes // e.shape[0]
            a, b = _chunk_rows(e.shape[0], n, r)
            if b > a:
                want.append((e.offset + a * row, (b - a) * row))
        assert own == sorted(want)
        covered += [(it.offset, it.nbytes) for it in res["items"]]
    if n <= 3:  # every rank's writes together: the whole file, each byte once
        covered.sort()
        assert covered[0][0] == 0
        assert all(a + la == b for (a, la), (b, _) in zip(covered, covered[1:]))
        assert covered[-1][0] + covered[-1][1] == m.files["data.bin"]["nbytes"]


def test_root_manifest_does_not_grow_with_the_rank_count():
    shapes = cs.llama_shapes(cs.parse_model(TINY))
    sizes = {}
    for n in (2, 1000):
        res = cs.ckpt_save_rank(0, n, shapes, "fsdp2", 8, BLOCK, CHUNK, memory=False)
        sizes[n] = len(cs.ckpt_root_commit(res["manifest"]).value)
    # only the digits of the mesh size (in each of the 3 x 21 layout rules) and of world_size differ
    assert sizes[1000] - sizes[2] == (len("1000") - len("2")) * (3 * len(shapes) + 1)


def test_planning_work_is_linear_in_tensors_and_flat_in_ranks():
    """Function calls of one rank's save planning (counted, not timed): 4x the layers cost at most
    4.4x the calls, and 64x the ranks (same tensors) at most 1.2x."""
    def calls(layers: int, n: int) -> int:
        cfg = TINY.replace("layers=2", f"layers={layers}")
        return cs.ckpt_save_rank(0, n, cs.llama_shapes(cs.parse_model(cfg)), "fsdp2", 8, BLOCK, CHUNK,
                                 count=True, memory=False)["calls"]

    base = calls(4, 16)
    assert calls(16, 16) <= 4.4 * base
    assert calls(4, 1024) <= 1.2 * base


def test_layout_arguments_are_checked(capsys):
    """fsdp2-tp needs rank counts that are multiples of the TP size; DCP is simulated for fsdp2 and
    hsdp only: both refused with what was expected."""
    assert cs.main(["--simulate-ranks", "12", "--layout", "fsdp2-tp", "--dcp", "no"]) == 2
    assert "multiples of --tp-size=8, got 12" in capsys.readouterr().out
    for layout in ("zero1", "fsdp2-tp"):
        assert cs.main(["--simulate-ranks", "16", "--layout", layout]) == 2
        assert "pass --dcp no" in capsys.readouterr().out
