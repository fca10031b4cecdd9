"""CompressedBackend on torch.distributed process groups (gloo, mpicomm): results and errors equal
MpiBackend's on the same inputs; the 1-bit optimizers take a process group as ``comm``; the
shape of DeepSpeed's compressed-backend test script runs under a plain init_process_group."""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import compressed
import mpicomm
from mpitest import check_all, gloo_init_method, mpiexec_cmd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_transport_needs_torch_distributed():
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        compressed.CompressedBackend()


@pytest.fixture(scope="module")
def groups():
    """{"gloo": group, "mpicomm": group} over the MPI world (a default gloo group made if none)."""
    world = MPI.COMM_WORLD
    made = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=gloo_init_method(world), rank=world.rank,
                                world_size=world.size, timeout=timedelta(seconds=120))
        made = True
    try:
        yield {"gloo": dist.new_group(backend="gloo"), "mpicomm": dist.new_group(backend="mpicomm")}
    finally:
        if made and dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["gloo", "mpicomm"])
@pytest.mark.parametrize("n", [7, 1000, 3 * 4099])
def test_equals_mpibackend_on_the_same_inputs(world, comm, groups, kind, n):
    def run():
        ours = compressed.CompressedBackend(groups[kind])
        ref = compressed.MpiBackend(comm=comm)
        assert (ours.rank, ours.size) == (comm.rank, comm.size)
        N = compressed.padded_size(n, comm.size)
        we, se = torch.zeros(N), torch.zeros(N // comm.size)
        we2, se2 = we.clone(), se.clone()
        gen = torch.Generator().manual_seed(comm.rank + n)
        for _ in range(3):   # consecutive calls: the error feedback carries over
            g = torch.randn(n, generator=gen) + 0.1 * comm.rank
            a, b = g.clone(), g.clone()
            out = ours.compressed_allreduce(a, we, se, 0)
            want = ref.compressed_allreduce(b, we2, se2, 0)
            assert out is a
            assert torch.equal(out, want) and torch.equal(we, we2) and torch.equal(se, se2)
        assert ours.wire_bytes == ref.wire_bytes

    check_all(run, world)


def _train(opt, params, steps: int, rank: int) -> None:
    for t in range(steps):
        gen = torch.Generator().manual_seed(100 * t + rank)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) + 0.1 * rank
        opt.step()


OPTIMIZERS = {
    "OnebitAdam": dict(lr=0.01, freeze_step=2),
    "ZeroOneAdam": dict(lr=0.01, var_freeze_step=5, var_update_scaler=1, local_step_scaler=1,
                        local_step_clipper=2),
    "OnebitLamb": dict(lr=0.01, freeze_step=2),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["gloo", "mpicomm"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers_take_a_process_group(world, comm, groups, kind, name):
    def run():
        cls, kw = getattr(compressed, name), OPTIMIZERS[name]
        torch.manual_seed(0)
        a = [torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(9))]
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        on_group, on_comm = cls(a, comm=groups[kind], **kw), cls(b, comm=comm, **kw)
        assert isinstance(on_group.comm, compressed.GroupTransport)
        _train(on_group, a, 9, comm.rank)
        _train(on_comm, b, 9, comm.rank)
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        if comm.size > 1:
            assert on_group.onebit.compressor.calls == on_comm.onebit.compressor.calls > 0

    check_all(run, world)


@pytest.mark.parametrize("backend", ["mpicomm", "gloo"])
def test_seed_script_shape_under_init_process_group(backend):
    from mpicomm import clean_env

    env = clean_env()
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([*mpiexec_cmd(2), sys.executable, os.path.join(ROOT, "tests", "cmp_seed_job.py"),
                           backend], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("0 failing positions (ok)") == 2, out


def test_as_comm_keeps_communicators():
    c = mpicomm.init()
    assert compressed.transport.as_comm(c) is c
    assert compressed.transport.as_comm(None).size == MPI.COMM_WORLD.size
    assert not compressed.transport.is_process_group(c)
