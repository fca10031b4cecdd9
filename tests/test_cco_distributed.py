"""torch.distributed backend "mpicomm" and DDP through it, against gloo as the reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import mpicomm
import mpicomm.distributed as md
from mpitest import assert_all, assert_close_all, gloo_init_method

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.fixture
def mpicomm_default_group():
    md.init_process_group()
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def gloo_and_mpicomm(world):
    """Default group on gloo (reference) plus an mpicomm group over the same ranks."""
    dist.init_process_group("gloo", init_method=gloo_init_method(world), rank=world.rank,
                            world_size=world.size)
    group = dist.new_group(backend="mpicomm")
    yield group
    dist.destroy_process_group()


def test_dist_calls_through_mpicomm(mpicomm_default_group, comm, world):
    assert_all(dist.get_backend() == "mpicomm", dist.get_backend())
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t)
    assert_close_all(t, np.full(3, n * (n + 1) / 2))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert_close_all(t, np.full(3, n * (n + 1) / 2))
    out = torch.empty(2 * n)
    dist.all_gather_into_tensor(out, torch.full((2,), float(r)))
    assert_close_all(out, np.repeat(np.arange(n, dtype=float), 2))
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * n) + r)
    assert_close_all(rs, (np.arange(2.0 * n) * n + n * (n - 1) / 2)[2 * r:2 * r + 2])
    b = torch.full((2,), float(r))
    dist.broadcast(b, src=n - 1)
    assert_close_all(b, np.full(2, float(n - 1)))
    a = torch.empty(n)
    dist.all_to_all_single(a, torch.arange(float(n)) + 10 * r)
    assert_close_all(a, np.arange(n) * 10.0 + r)
    outs = [torch.empty(1) for _ in range(n)]
    dist.all_gather(outs, torch.tensor([float(r)]))
    assert_close_all(torch.cat(outs), np.arange(n, dtype=float))
    work = dist.all_reduce(torch.ones(4), async_op=True)
    work.wait()
    dist.barrier()


def _train(model, steps, rank, lr=0.05):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 10, generator=gen)
        y = x[:, :3].sum(dim=1, keepdim=True)
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def test_ddp_through_mpicomm_matches_gloo(gloo_and_mpicomm, world):
    rank = world.rank
    ref = _train(DDP(_model()), 20, rank)  # default group: gloo
    calls = []
    original = md.MpicommProcessGroup.allreduce

    def counting(self, tensors, opts=None):
        calls.append(sum(t.numel() for t in tensors))
        return original(self, tensors, opts)

    md.MpicommProcessGroup.allreduce = counting
    try:
        ours = _train(DDP(_model(), process_group=gloo_and_mpicomm), 20, rank)
    finally:
        md.MpicommProcessGroup.allreduce = original
    assert_all(len(calls) >= 20, f"DDP's gradients did not go through mpicomm ({len(calls)} calls)")
    assert_close_all(ours, ref.numpy(), atol=1e-6, what="DDP on mpicomm vs gloo")
    # parameters agree across ranks
    assert_close_all(ours, world.bcast(ours.numpy(), root=0))


def test_ddp_comm_hook_on_another_group(gloo_and_mpicomm, world):
    rank = world.rank
    ref = _train(DDP(_model()), 20, rank)
    model = DDP(_model())
    model.register_comm_hook(mpicomm.init(), md.allreduce_ddp_hook)
    ours = _train(model, 20, rank)
    assert_close_all(ours, ref.numpy(), atol=1e-6, what="DDP + mpicomm hook vs gloo")


def test_timeout_error_is_a_dist_backend_error_and_old_names_are_gone():
    for old in ("allreduce_hook", "CollectiveTimeoutError"):
        assert not hasattr(md, old)
    assert issubclass(md.ProcessGroupTimeoutError, dist.DistBackendError)
    assert not issubclass(mpicomm.WaitTimeoutError, md.ProcessGroupTimeoutError)
