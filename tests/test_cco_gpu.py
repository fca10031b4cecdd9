"""Collectives on CUDA tensors and cupy arrays, through the staged and (when MPI is CUDA-aware) direct paths.

Skipped without CUDA. Run on a GPU machine with ./scripts/gpu_check.sh.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

import mpicomm
from mpicomm.device_paths import DevicePolicy
from mpitest import assert_close_all

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FRAMEWORKS = ["torch"] + (["cupy"] if importlib.util.find_spec("cupy") else [])


@pytest.fixture(params=["staged", "direct"])
def gpu_comm(request, comm):
    from accelerators import get_accelerator

    acc = get_accelerator()
    acc.set_device(acc.local_rank().rank % acc.device_count())
    sub = mpicomm.Communicator(comm.mpi_comm.Dup())
    if request.param == "direct":
        verdict = acc.cuda_aware_verdict()
        if not verdict.value:
            pytest.skip(f"MPI is not known to be CUDA-aware ({verdict.source}: {verdict.reason})")
        sub._policy = DevicePolicy(True, "test", {})
    else:
        sub._policy = DevicePolicy(False, "test: forced staging", {})
    yield sub
    sub.free()


def _dev(fw, array: np.ndarray):
    if fw == "cupy":
        import cupy

        return cupy.asarray(array)
    return torch.from_numpy(array).cuda()


def _host(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy().astype(np.float64)
    return x.get().astype(np.float64)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_all_reduce_and_friends(gpu_comm, world, fw):
    c = gpu_comm
    n = c.size
    x = _dev(fw, np.arange(10, dtype=np.float32) + c.rank)
    c.all_reduce(x)
    assert_close_all(_host(x), np.arange(10) * n + n * (n - 1) / 2)
    out = _dev(fw, np.zeros(3 * n, dtype=np.float32))
    c.all_gather_into_tensor(out, _dev(fw, np.full(3, c.rank, dtype=np.float32)))
    assert_close_all(_host(out), np.repeat(np.arange(n, dtype=float), 3))
    rs = _dev(fw, np.zeros(2, dtype=np.float32))
    c.reduce_scatter_tensor(rs, _dev(fw, np.arange(2 * n, dtype=np.float32)), op="avg")
    assert_close_all(_host(rs), np.arange(2 * n)[2 * c.rank:2 * c.rank + 2])
    b = _dev(fw, np.full(4, c.rank, dtype=np.int64))
    c.broadcast(b, src=n - 1)
    assert_close_all(_host(b), np.full(4, n - 1))
    a = _dev(fw, np.zeros(n, dtype=np.float32))
    c.all_to_all_single(a, _dev(fw, np.arange(n, dtype=np.float32) + 10 * c.rank))
    assert_close_all(_host(a), np.arange(n) * 10.0 + c.rank)


def test_bf16_noncontiguous_and_async_on_cuda(gpu_comm):
    c = gpu_comm
    base = torch.ones(6, 4, device="cuda", dtype=torch.bfloat16)
    view = base[:, 1]
    c.all_reduce(view, op="avg")
    assert_close_all(_host(view), np.ones(6))
    y = torch.arange(1000, device="cuda", dtype=torch.float32) * (c.rank + 1)
    torch.cuda._sleep(1000000)  # pending work on the stream: mpicomm must order after it
    work = c.all_reduce(y, async_op=True)
    work.wait()
    assert_close_all(_host(y), np.arange(1000) * c.size * (c.size + 1) / 2)


@pytest.mark.parametrize("path", ["small", "pipelined"])
@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_reduce16_on_cuda_against_numpy(gpu_comm, world, monkeypatch, path, name):
    """16-bit reductions of CUDA tensors (staged: the host kernel; direct: torch kernels on the
    device) give the numpy reference's bits, every op, on both paths."""
    from mpicomm import reduce16
    from test_cco_reduce16 import FACTOR, _bits, inputs, reference

    if path == "pipelined":
        monkeypatch.setattr(reduce16, "SMALL_BYTES", 0)
        monkeypatch.setattr(reduce16, "SEGMENT_BYTES", 2000)
    c, bad = gpu_comm, []
    n = 3001 * c.size + 1
    for op in ("sum", "avg", "max", "min", "premul"):
        host = inputs(c.rank, n * c.size, name, 11)
        rows = np.stack(world.allgather(_bits(host)))
        want = reference(rows, name, op)
        ours, factor = ("sum", FACTOR) if op == "premul" else (op, None)
        x = host.cuda()
        c.all_reduce(x, ours, factor=factor)
        out = torch.empty(n, dtype=host.dtype, device="cuda")
        c.reduce_scatter_tensor(out, host.cuda(), ours, factor=factor)
        r = host.cuda()
        c.reduce(r, c.size - 1, ours, async_op=True, factor=factor).wait()
        checks = [("all_reduce", _bits(x.cpu()), want),
                  ("reduce_scatter", _bits(out.cpu()), want[c.rank * n:(c.rank + 1) * n]),
                  ("reduce", _bits(r.cpu()), want if c.rank == c.size - 1 else _bits(host))]
        bad += [f"{call} {op}" for call, got, exp in checks if not np.array_equal(got, exp)]
    assert not bad, f"differ from numpy: {bad}"
