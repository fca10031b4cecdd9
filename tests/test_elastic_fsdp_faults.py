"""Fault injection with FSDP2: one rank os._exit(9)s while an FSDP2 model (``fully_shard``) with
AdamW trains under elastic.run on Open MPI with ULFM; the survivors rebuild the model on their
mesh (elastic.RebuildFSDP), get the committed DTensor shards re-partitioned, and their final
weights must equal a single-process plain torch run on the same global batches.

Each case is one job (tests/elastic_fsdp_job.py) launched from a one-process test with a
timeout; skipped where the MPI beside this Python has no ULFM (the MPICH wheel)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import elastic_job_lib
from elastic_job_lib import LR
from test_elastic_faults import _disk_job, _launch, _published_checkpoints_are_whole, _ulfm

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 5


def reference(steps: int) -> list[torch.Tensor]:
    """Final weights after ``steps`` AdamW steps on the global batches, one process, no FSDP."""
    return elastic_job_lib.reference(
        steps, lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.1))


# (ranks, where, victim, step): rank 0 (the store's host) between steps, 3 -> 2 ranks (7 rows:
# 3+3+1 -> 4+3); a non-zero rank inside backward, 4 -> 3 ranks (3 rows: 1+1+1+0 -> 1+1+1);
# rank 0 inside commit() (its shards' send issued), 4 -> 3 ranks; a non-zero rank inside the
# optimizer step, 3 -> 2 ranks
CASES = [(3, "between", 0, 2), (4, "backward", 2, 1), (4, "commit", 0, 2), (3, "ostep", 1, 3)]


@pytest.mark.parametrize("n,where,victim,step", CASES, ids=[f"{n}ranks-{w}-rank{v}" for n, w, v, _ in CASES])
def test_fsdp2_survivors_end_with_the_reference_weights(tmp_path, n, where, victim, step):
    _ulfm()
    out = str(tmp_path / "run")
    proc = _launch(n, [os.path.join(HERE, "elastic_fsdp_job.py"), where, str(victim), str(step), str(STEPS), out],
                   timeout=180)
    log = f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert os.path.exists(out + ".json"), log
    with open(out + ".json") as f:
        info = json.load(f)
    assert info["world_size"] == info["dist_world_size"] == info["mesh_size"] == n - 1, (info, log)
    assert [r["lost"] for r in info["recoveries"]] == [[victim]], (info, log)
    got = np.load(out + ".npz")
    for i, ref in enumerate(reference(STEPS)):
        np.testing.assert_allclose(got[f"p{i}"], ref.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"param {i}\n{log}")


def test_fsdp2_grows_back_with_a_replacement(tmp_path):
    """4 ranks, rank 1 killed between steps, elastic.run(max_world_size=4): a replacement joins
    with its FSDP2 shards from the live ranks, and the 4-rank model ends with the reference weights."""
    _ulfm()
    out = str(tmp_path / "run")
    proc = _launch(4, [os.path.join(HERE, "elastic_fsdp_job.py"), "between", "1", "2", str(STEPS), out, "grow=4"],
                   timeout=180)
    log = f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert os.path.exists(out + ".json"), log
    with open(out + ".json") as f:
        info = json.load(f)
    assert info["world_size"] == info["dist_world_size"] == info["mesh_size"] == 4, (info, log)
    assert [r["lost"] for r in info["recoveries"]] == [[1]], (info, log)
    assert [g["spawned"] for g in info["growths"]] == [1], (info, log)
    got = np.load(out + ".npz")
    for i, ref in enumerate(reference(STEPS)):
        np.testing.assert_allclose(got[f"p{i}"], ref.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"param {i}\n{log}")


def test_fsdp2_shard_lost_with_its_replica_falls_back_to_the_disk_checkpoint(tmp_path):
    """4 ranks, FSDP2 with Adam, a checkpoint every 2 commits (tests/elastic_disk_job.py): ranks 1
    and 2 are SIGKILLed together at step 5, so rank 1's local shards and their replica (on rank 2)
    are gone; the two survivors rebuild the model on their mesh (RebuildFSDP), load the newest
    committed checkpoint into it (saved at 4 ranks, re-partitioned over 2 by ckpt) and end with
    the weights of the single-process Adam reference."""
    _ulfm()
    info, log = _disk_job(tmp_path, 4, ["1,2", "5"], layout="fsdp2", timeout=180, ref=elastic_job_lib.reference)
    assert info["world_size"] == info["dist_world_size"] == 2 and info["commits"] == STEPS + 2, (info, log)
    (rec,) = info["recoveries"]
    assert rec["lost"] == [1, 2] and rec["survivors"] == [0, 3], rec
    assert rec["from_disk"]["saved_world_size"] == 4 and rec["from_disk"]["commits"] in (2, 4), rec
    assert rec["from_disk"]["path"].endswith(f"step{rec['from_disk']['commits']}"), rec


def test_fsdp2_a_host_lost_whole_is_recovered_in_memory(tmp_path):
    """4 ranks in two failure domains of two (as two hosts): the replicas go 2 ranks on, so
    when ranks 0 and 1 (one "host") are SIGKILLed together at step 3, ranks 2 and 3 hold both
    lost shards' replicas and recover in memory, no disk, to the Adam reference weights."""
    _ulfm()
    info, log = _disk_job(tmp_path, 4, ["0,1", "3", "domains:2"], layout="fsdp2", timeout=180,
                          ref=elastic_job_lib.reference)
    assert info["world_size"] == info["dist_world_size"] == 2 and info["stride"] == 1, (info, log)
    (rec,) = info["recoveries"]
    assert rec["lost"] == [0, 1] and rec["survivors"] == [2, 3] and rec["from_disk"] is None, rec


def test_fsdp2_rank_dying_inside_an_async_checkpoint_save(tmp_path):
    """3 ranks, FSDP2 with Adam: rank 1 dies inside the write of the checkpoint taken at commit 2;
    the survivors recover in memory (RebuildFSDP), the recovery writes that checkpoint again from
    the rebuilt model, and they end with the Adam reference weights; every published checkpoint
    verifies."""
    _ulfm()
    info, log = _disk_job(tmp_path, 3, ["1", "2", "insave"], layout="fsdp2", steps=STEPS, timeout=180,
                          ref=elastic_job_lib.reference)
    assert info["world_size"] == 2 and [r["lost"] for r in info["recoveries"]] == [[1]], (info, log)
    assert info["recoveries"][0]["save_in_flight"] == "failed" and info["recoveries"][0]["from_disk"] is None, info
    assert _published_checkpoints_are_whole(str(tmp_path / "ck"))[-1] == "step4", os.listdir(tmp_path / "ck")
