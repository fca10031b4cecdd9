"""The 1-bit family on CUDA: CompressedBackend over an NCCL process group equals MpiBackend on
the same CUDA inputs bit for bit, and ZeroOneAdam / OnebitLamb / OnebitAdam on CUDA parameters
(over mpicomm and over NCCL) equal the same optimizers on CPU parameters.

Skipped without CUDA; the NCCL tests need one GPU per rank. Run on a GPU machine with
./scripts/gpu_check.sh (1 and 2 ranks).
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import compressed
from mpitest import check_all, gloo_init_method

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)")]


@pytest.fixture(scope="module")
def nccl_group(device):
    """An NCCL process group over the MPI world: rank and size from MPI, a TCP store on rank 0.

    The default group when this module creates it, else a new NCCL group beside the existing one.
    """
    world = MPI.COMM_WORLD
    if torch.cuda.device_count() < world.size:   # the same answer on every rank: no collective
        pytest.skip(f"NCCL needs one GPU per rank: {world.size} ranks, "
                    f"{torch.cuda.device_count()} GPUs")
    if dist.is_initialized():
        yield dist.new_group(backend="nccl")
        return
    dist.init_process_group("nccl", init_method=gloo_init_method(world), rank=world.rank,
                            world_size=world.size, timeout=timedelta(seconds=120))
    try:
        yield None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("n", [7, 1000, 3 * 4099])
def test_compressed_backend_on_nccl_equals_mpibackend(world, comm, device, nccl_group, n):
    def run():
        ours = compressed.CompressedBackend(nccl_group)
        ref = compressed.MpiBackend(comm=comm)        # the mpicomm path (staged through the host)
        assert ours.comm.backend == "nccl" and (ours.rank, ours.size) == (comm.rank, comm.size)
        N = compressed.padded_size(n, comm.size)
        we, se = torch.zeros(N, device=device), torch.zeros(N // comm.size, device=device)
        we2, se2 = we.clone(), se.clone()
        gen = torch.Generator().manual_seed(comm.rank + n)
        for _ in range(3):   # consecutive calls: the error feedback carries over
            g = (torch.randn(n, generator=gen) + 0.1 * comm.rank).to(device)
            a, b = g.clone(), g.clone()
            out = ours.compressed_allreduce(a, we, se, device.index)
            want = ref.compressed_allreduce(b, we2, se2, device.index)
            assert out is a and out.device == device
            assert torch.equal(out, want), (out - want).abs().max()
            assert torch.equal(we, we2) and torch.equal(se, se2)
        assert ours.wire_bytes == ref.wire_bytes

    check_all(run, world)


def _train(opt, params, steps: int, rank: int) -> None:
    for t in range(steps):
        gen = torch.Generator().manual_seed(100 * t + rank)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) + 0.1 * rank).to(p.device)
        opt.step()


OPTIMIZERS = {
    "OnebitAdam": dict(lr=0.01, freeze_step=2),
    "ZeroOneAdam": dict(lr=0.01, var_freeze_step=5, var_update_scaler=1, local_step_scaler=1,
                        local_step_clipper=2),
    "OnebitLamb": dict(lr=0.01, freeze_step=2),
}


def _cuda_equals_cpu(world, comm, device, on, name) -> None:
    cls, kw = getattr(compressed, name), OPTIMIZERS[name]
    torch.manual_seed(0)
    cpu = [torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(300))]
    gpu = [torch.nn.Parameter(p.detach().clone().to(device)) for p in cpu]
    opt_cpu, opt_gpu = cls(cpu, comm=comm, **kw), cls(gpu, comm=on, **kw)
    _train(opt_cpu, cpu, 9, comm.rank)
    _train(opt_gpu, gpu, 9, comm.rank)
    for p, q in zip(gpu, cpu):
        assert p.device == device
        # the kernels differ (reduction order of the norms), the algorithm does not
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5)
    if comm.size > 1:
        assert opt_gpu.onebit.compressor.calls == opt_cpu.onebit.compressor.calls > 0


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers_on_cuda_equal_cpu_over_mpicomm(world, comm, device, name):
    check_all(lambda: _cuda_equals_cpu(world, comm, device, comm, name), world)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers_on_cuda_equal_cpu_over_nccl(world, comm, device, nccl_group, name):
    def run():
        group = nccl_group if nccl_group is not None else dist.group.WORLD
        _cuda_equals_cpu(world, comm, device, group, name)

    check_all(run, world)
