"""hvd.elastic under ``mpirun --with-ft ulfm`` (Open MPI): a rank killed between steps or inside
backward; the survivors' final weights equal a single-process plain torch run on the same
global batches (tests/elastic_job_lib.py). Also hvd.elastic's pieces that need no failure."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from mpi4py import MPI

from elastic_job_lib import reference
from mpicomm import clean_env
from mpitest import mpiexec_cmd
from ulfm_guard import require_ulfm

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS = 5


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="launches its own MPI jobs")
@pytest.mark.parametrize("where,victim,step", [("between", 1, 2), ("backward", 2, 3)])
def test_hvd_elastic_survivors_end_with_the_reference_weights(tmp_path, where, victim, step):
    require_ulfm()
    out = str(tmp_path / "run")
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, env.get("PYTHONPATH", "")])
    cmd = [*mpiexec_cmd(3), "--with-ft", "ulfm", sys.executable, "-m", "mpi4py",
           os.path.join(HERE, "horovod_elastic_job.py"), where, str(victim), str(step),
           str(STEPS), out]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the job hung: {exc.stdout}\n{exc.stderr}") from None
    log = (proc.stdout + proc.stderr)[-6000:]
    assert os.path.exists(out + ".json"), log
    info = json.load(open(out + ".json"))
    assert info == {"size": 2, "recoveries": 1}, (info, log)
    got = np.load(out + ".npz")
    for i, ref in enumerate(reference(STEPS)):
        np.testing.assert_allclose(got[f"p{i}"], ref.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=f"parameter {i}\n{log}")


@pytest.mark.mpi(min_size=1)
def test_elastic_sampler_splits_the_rest_after_progress(world):
    import mpicomm.horovod as hvd
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    data = list(range(23))
    s = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    order = torch.randperm(23, generator=torch.Generator().manual_seed(3)).tolist()
    padded = order + order[:(-len(order)) % n]
    assert list(s) == padded[r::n]
    s.record_batch(0, 2)                         # each rank processed its first two
    s.sync_processed()
    done = {i for k in range(n) for i in padded[k::n][:2]}
    assert s.processed_indices == done
    state = s.state_dict()
    t = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    t.load_state_dict(state)
    left = [i for i in order if i not in done]
    left += left[:(-len(left)) % n]
    assert list(t) == left[r::n] and len(t) == len(left) // n
    t.set_epoch(1)
    assert t.processed_indices == set() and len(t) == len(padded) // n


@pytest.mark.mpi(min_size=1)
def test_torch_state_save_restore_and_sync(world):
    import mpicomm.horovod as hvd
    hvd.init()
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = hvd.elastic.TorchState(model, opt, epoch=4)
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state.epoch = 9
    state.restore()
    assert state.epoch == 4
    for p, q in zip(model.parameters(), saved):
        assert torch.equal(p.detach(), q)
    state.epoch = 10 + hvd.rank()
    state.sync()
    root = hvd.broadcast_object([p.detach() for p in model.parameters()], 0)
    assert state.epoch == 10
    for p, q in zip(model.parameters(), root):
        assert torch.equal(p.detach(), q)
    state.check_host_updates()                  # no discovery script: nothing to do
    assert issubclass(hvd.elastic.HostsUpdatedInterrupt, RuntimeError)
    assert issubclass(hvd.elastic.HorovodInternalError, RuntimeError)
