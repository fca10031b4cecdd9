"""OnebitDDPState on a torch.distributed process group (gloo, mpicomm): the hook's averaged
gradients equal those of the same hook on an mpicomm Communicator (the MpiBackend path) bit for
bit, compressed steps included, and the warm-up steps equal a float64 mean."""
from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import compressed
import mpicomm  # noqa: F401 - registers the "mpicomm" backend
from mpitest import check_all, gloo_init_method


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


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 2))


def grads(ddp: torch.nn.Module, step: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(16, 20, generator=g), torch.randn(16, 2, generator=g) + 0.1 * rank
    ddp.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    return [p.grad.detach().clone() for p in ddp.parameters()]


def float64_mean(world: MPI.Comm, local: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for t in local:
        a = t.double().numpy().copy()
        world.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
        out.append(torch.from_numpy(a / world.size))
    return out


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["gloo", "mpicomm"])
def test_hook_on_a_group_equals_the_communicator_path(world, comm, groups, kind):
    def run():
        warmup, steps = 2, 6
        on_group = compressed.OnebitDDPState(groups[kind], warmup_steps=warmup, min_bucket_numel=0)
        on_comm = compressed.OnebitDDPState(comm, warmup_steps=warmup, min_bucket_numel=0)
        assert isinstance(on_group.comm, compressed.GroupTransport)
        assert (on_group.comm.rank, on_group.comm.size) == (comm.rank, comm.size)
        models = []
        for state in (on_group, on_comm):
            ddp = torch.nn.parallel.DistributedDataParallel(make_model(), process_group=groups[kind])
            ddp.register_comm_hook(state, compressed.onebit_ddp_hook)
            models.append(ddp)
        local = make_model()   # this rank's own gradients, for the float64 reference
        for step in range(steps):
            a = grads(models[0], step, world.rank)
            b = grads(models[1], step, world.rank)
            if step < warmup:   # uncompressed: both the exact mean (the sum order may differ)
                want = float64_mean(world, grads(local, step, world.rank))
                for x, y, w in zip(a, b, want):
                    torch.testing.assert_close(x.double(), w, rtol=1e-6, atol=1e-7)
                    torch.testing.assert_close(y.double(), w, rtol=1e-6, atol=1e-7)
            else:               # compressed: one engine, one wire format, bit for bit
                for x, y in zip(a, b):
                    assert torch.equal(x, y), (step, (x - y).abs().max())
        assert on_group.step == on_comm.step == steps
        assert on_group.compressed_buckets == on_comm.compressed_buckets >= steps - warmup
        if world.size > 1:
            # the compressed steps really were 1-bit: not the exact mean
            want = float64_mean(world, grads(local, steps - 1, world.rank))
            flat = torch.cat([t.reshape(-1) for t in a]).double()
            assert not torch.allclose(flat, torch.cat([t.reshape(-1) for t in want]), rtol=1e-3)
            ea, eb = on_group.allreduce.state_dict(), on_comm.allreduce.state_dict()
            assert _same_state(ea, eb)   # the error buffers too

    check_all(run, world)


def _same_state(a, b) -> bool:
    """Nested dicts/lists of tensors and plain values, equal bit for bit."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b
