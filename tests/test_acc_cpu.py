"""The CPU accelerator, for real (no fakes needed)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from accelerators import CpuAccelerator, LocalRankWarning

LAUNCH_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALRANKID",
               "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK",
               "PALS_LOCAL_RANKID", "SLURM_LOCALID", "MPICOMM_LOCAL_RANK")


@pytest.fixture
def clean_env(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_devices():
    acc = CpuAccelerator()
    assert acc.name == "cpu" and acc.is_available()
    assert acc.device_count() == 1 and acc.current_device() == 0
    assert acc.device_name() == "cpu" and acc.device_name(0) == "cpu"
    assert acc.current_device_name() == "cpu"
    assert acc.device() == torch.device("cpu")
    acc.set_device(0)
    with pytest.raises(ValueError, match="cpu device index 1 out of range: 1 device"):
        acc.set_device(1)
    with pytest.raises(ValueError, match="must be an int >= 0, got -1"):
        acc.device_name(-1)
    assert torch.zeros(2, device=acc.current_device_name()).device.type == "cpu"


def test_buffers_are_host_buffers():
    acc = CpuAccelerator()
    t = torch.ones(3)
    assert acc.on_accelerator(t) and not acc.on_accelerator(np.ones(3))
    assert not acc.is_device_buffer(t) and not acc.is_device_buffer(np.ones(3))


def test_streams_and_events():
    acc = CpuAccelerator()
    acc.synchronize()
    acc.stream_synchronize()
    stream = acc.new_stream()
    with acc.stream(stream) as s:
        assert s is stream
    assert acc.current_stream().query()
    start, end = acc.new_event(enable_timing=True), acc.new_event(enable_timing=True)
    # bracketed by the clock read around each record (1 ms slack for another clock): no sleep
    t0 = time.perf_counter()
    start.record()
    t1 = time.perf_counter()
    sum(range(20000))
    t2 = time.perf_counter()
    end.record()
    t3 = time.perf_counter()
    end.synchronize()
    assert (t2 - t1) * 1e3 - 1.0 <= start.elapsed_time(end) <= (t3 - t0) * 1e3 + 1.0
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        acc.new_event().elapsed_time(acc.new_event())
    with pytest.raises(RuntimeError, match="recorded first"):
        acc.new_event(True).elapsed_time(acc.new_event(True))


def test_memory():
    acc = CpuAccelerator()
    t = torch.arange(6.0)
    assert acc.pin_memory(t) is t and acc.is_pinned(t) is False
    buf = acc.empty_host((2, 3), torch.bfloat16)
    assert buf.shape == (2, 3) and buf.dtype == torch.bfloat16 and buf.device.type == "cpu"
    assert acc.empty_host(5, torch.int8, pinned=False).shape == (5,)
    assert acc.memory_allocated() == 0 and acc.max_memory_allocated() == 0
    acc.empty_cache()
    assert acc.total_memory() > 2**28


def test_dtypes_compute_on_cpu():
    acc = CpuAccelerator()
    dtypes = acc.supported_dtypes()
    assert acc.is_bf16_supported() and acc.is_fp16_supported()
    assert {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64} <= set(dtypes)
    for dtype in dtypes:  # each claimed dtype really sums on the CPU
        x = torch.ones(4, dtype=dtype)
        assert int((x + x).sum().item()) == (4 if dtype == torch.bool else 8), dtype


def test_rng_matches_an_independent_generator():
    acc = CpuAccelerator()
    acc.manual_seed(1234)
    got = torch.randn(5)
    expected = torch.randn(5, generator=torch.Generator().manual_seed(1234))
    assert torch.equal(got, expected)
    state = acc.get_rng_state()
    first = torch.rand(3)
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    acc.manual_seed_all(7)
    assert torch.equal(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(7)))


def test_communication():
    acc = CpuAccelerator()
    assert acc.communication_backend_name() == "mpi"
    verdict = acc.cuda_aware_verdict()
    assert (verdict.value, verdict.source) == (False, "cpu accelerator")
    assert acc.is_cuda_aware_mpi() is False
    assert acc.cuda_aware_verdict() is verdict


def test_local_rank_from_env_is_cached(clean_env):
    clean_env.setenv("MPI_LOCALRANKID", "3")
    clean_env.setenv("MPI_LOCALNRANKS", "4")
    acc = CpuAccelerator()
    first = acc.local_rank()
    assert (first.rank, first.size, first.source) == (3, 4, "MPI_LOCALRANKID")
    clean_env.setenv("MPI_LOCALRANKID", "1")
    assert acc.local_rank() is first
    assert acc.local_device_index() == 0 and acc.set_local_device() == 0


def test_explicit_local_rank_and_warning(clean_env):
    clean_env.setenv("SLURM_LOCALID", "0")
    acc = CpuAccelerator(local_rank=2)
    with pytest.warns(LocalRankWarning, match="SLURM_LOCALID says local rank 0"):
        got = acc.local_rank()
    assert (got.rank, got.source) == (2, "explicit")
    acc.set_local_rank(None)
    assert acc.local_rank().source == "SLURM_LOCALID"
    acc.set_local_rank(1)
    with pytest.warns(LocalRankWarning, match="says local rank 0 but explicit says 1"):
        assert acc.local_rank().rank == 1
    with pytest.raises(ValueError, match="local rank must be an int >= 0 or None, got -2"):
        acc.set_local_rank(-2)
    with pytest.raises(ValueError, match="local_rank must be an int >= 0 or None"):
        CpuAccelerator(local_rank="0")
