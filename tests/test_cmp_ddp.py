"""onebit_ddp_hook on DDP over a gloo process group, its traffic through mpicomm."""
from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import compressed
from mpitest import check_all, gloo_init_method


@pytest.fixture(scope="module")
def gloo_group():
    """A gloo process group over the MPI world (the default one, created here if none exists)."""
    world = MPI.COMM_WORLD
    if dist.is_initialized():
        yield dist.new_group(backend="gloo")
        return
    try:
        dist.init_process_group("gloo", init_method=gloo_init_method(world), rank=world.rank,
                                world_size=world.size, timeout=timedelta(seconds=120))
        yield None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 2))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 20, generator=g), torch.randn(16, 2, generator=g)


def exact_mean_grads(world: MPI.Comm, step: int) -> list[torch.Tensor]:
    model = make_model()
    x, y = batch(step, world.rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    out = []
    for p in model.parameters():
        a = p.grad.double().numpy().copy()
        world.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
        out.append(torch.from_numpy(a / world.size).float())
    return out


def ddp_grads(ddp: torch.nn.Module, step: int, rank: int) -> list[torch.Tensor]:
    ddp.zero_grad()
    x, y = batch(step, rank)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    return [p.grad.detach().clone() for p in ddp.parameters()]


@pytest.mark.mpi(min_size=1)
def test_warmup_exact_then_compressed(world, comm, gloo_group):
    def run():
        state = compressed.OnebitDDPState(comm, warmup_steps=2, min_bucket_numel=0)
        ddp = torch.nn.parallel.DistributedDataParallel(make_model(), process_group=gloo_group)
        ddp.register_comm_hook(state, compressed.onebit_ddp_hook)
        for step in range(2):
            got = ddp_grads(ddp, step, world.rank)
            for g, want in zip(got, exact_mean_grads(world, step)):
                torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
        assert state.step == 2 and state.compressed_buckets == 0
        got = ddp_grads(ddp, 2, world.rank)
        want = exact_mean_grads(world, 2)
        assert state.step == 3 and state.compressed_buckets >= 1
        flat = torch.cat([g.reshape(-1) for g in got])
        flat_want = torch.cat([g.reshape(-1) for g in want])
        if world.size == 1:
            torch.testing.assert_close(flat, flat_want, rtol=1e-5, atol=1e-6)
            return
        # 1-bit: every value is +-(one server scale per chunk and bucket); signs mostly agree
        mags = np.unique(np.round(flat.abs().numpy(), 6))
        assert len(mags) <= world.size * state.compressed_buckets, mags
        agree = float((torch.sign(flat) == torch.sign(flat_want)).float().mean())
        assert agree > 0.6, agree
        assert not torch.allclose(flat, flat_want, rtol=1e-3)

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
def test_small_buckets_stay_uncompressed(world, comm, gloo_group):
    def run():
        state = compressed.OnebitDDPState(comm, warmup_steps=0, min_bucket_numel=10**9)
        ddp = torch.nn.parallel.DistributedDataParallel(make_model(), process_group=gloo_group)
        ddp.register_comm_hook(state, compressed.onebit_ddp_hook)
        for step in range(3):
            got = ddp_grads(ddp, step, world.rank)
            for g, want in zip(got, exact_mean_grads(world, step)):
                torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
        assert state.compressed_buckets == 0 and state.uncompressed_buckets >= 3 and state.step == 3

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
def test_training_with_hook_reduces_loss(world, comm, gloo_group):
    def run():
        state = compressed.OnebitDDPState(comm, warmup_steps=5, min_bucket_numel=0)
        ddp = torch.nn.parallel.DistributedDataParallel(make_model(), process_group=gloo_group)
        ddp.register_comm_hook(state, compressed.onebit_ddp_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        g = torch.Generator().manual_seed(7)
        w = torch.randn(20, 2, generator=g)
        gen = torch.Generator().manual_seed(world.rank)
        xt = torch.randn(256, 20, generator=g)
        with torch.no_grad():
            first = float(torch.nn.functional.mse_loss(ddp.module(xt), xt @ w))
        for _ in range(100):
            x = torch.randn(32, 20, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), x @ w).backward()
            opt.step()
        with torch.no_grad():
            last = float(torch.nn.functional.mse_loss(ddp.module(xt), xt @ w))
        assert last < first / 10, (first, last)
        p0 = [p.detach().clone() for p in ddp.parameters()]
        gathered = world.allgather([t.numpy() for t in p0])
        for other in gathered:
            for a, b in zip(other, p0):
                np.testing.assert_array_equal(a, b.numpy())  # replicas stay identical

    check_all(run, world)
