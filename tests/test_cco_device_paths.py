"""The per-operation CUDA-aware table and the staging pool (pure logic, no GPU needed)."""
from __future__ import annotations

import pytest
import torch

from accelerators import CpuAccelerator, CudaAwareVerdict, registry
from mpicomm import device_paths
from mpicomm.device_paths import DevicePolicy, StagingPool, parse_overrides


def test_parse_overrides():
    assert parse_overrides("") == {}
    assert parse_overrides(" IAllreduce=0, alltoall=1 ,") == {"iallreduce": False, "alltoall": True}
    for bad in ("iallreduce", "iallreduce=yes", "=1"):
        with pytest.raises(ValueError, match="MPICOMM_CUDA_AWARE_OPS"):
            parse_overrides(bad)


def test_policy_answers_per_operation():
    yes = DevicePolicy(True, "test", {"iallreduce": False})
    assert yes.direct("allreduce") and yes.direct("alltoall")
    assert not yes.direct("iallreduce")
    for verdict in (False, None):  # no or unknown: always stage
        assert not DevicePolicy(verdict, "test", {"allreduce": True}).direct("allreduce")


class _FakeAccelerator(CpuAccelerator):
    def __init__(self, verdict):
        super().__init__()
        self._fake_verdict = verdict

    def cuda_aware_verdict(self):
        return self._fake_verdict


@pytest.fixture
def fake_accelerator(monkeypatch):
    def install(value):
        acc = _FakeAccelerator(CudaAwareVerdict(value, "fake", "set by the test"))
        monkeypatch.setattr(registry, "_accelerator", acc)
        return acc
    return install


def test_detect_uses_verdict_vendor_table_and_environment(fake_accelerator, monkeypatch):
    from mpi4py import MPI

    fake_accelerator(True)
    monkeypatch.setattr(MPI, "get_vendor", lambda: ("Open MPI", (5, 0, 0)))
    monkeypatch.setenv("MPICOMM_CUDA_AWARE_OPS", "alltoall=0")
    policy = DevicePolicy.detect()
    assert policy.cuda_aware is True and "fake" in policy.reason
    assert policy.direct("allreduce") and policy.direct("bcast")
    assert not policy.direct("iallreduce") and not policy.direct("ireduce_scatter_block")
    assert not policy.direct("alltoall")
    monkeypatch.setattr(MPI, "get_vendor", lambda: ("MPICH", (5, 0, 2)))
    monkeypatch.setenv("MPICOMM_CUDA_AWARE_OPS", "")
    assert DevicePolicy.detect().direct("iallreduce")
    fake_accelerator(None)
    assert not DevicePolicy.detect().direct("allreduce")


def test_staging_pool_reuses_buffers_by_size_class():
    pool = StagingPool()
    a = pool.acquire((3, 5), torch.float32)
    assert a.shape == (3, 5) and a.dtype == torch.float32 and not a.is_cuda
    raw = a.untyped_storage()
    assert raw.nbytes() == 64  # 60 bytes rounded up to a power of two
    pool.release(a)
    b = pool.acquire((16,), torch.int32)  # 64 bytes: the same size class, the same memory
    assert b.untyped_storage().data_ptr() == raw.data_ptr()
    c = pool.acquire((16,), torch.int32)  # the class is empty now: a new buffer
    assert c.untyped_storage().data_ptr() != raw.data_ptr()
    pool.release(b)
    pool.release(c)
    empty = pool.acquire((0,), torch.float64)
    assert empty.numel() == 0
    pool.clear()
    assert device_paths.STAGING is not pool
