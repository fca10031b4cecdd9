"""The CUDA accelerator for real, on a machine with an NVIDIA GPU (skipped without CUDA)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from accelerators import CudaAccelerator, registry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs CUDA (torch.cuda.is_available())"),
]


@pytest.fixture
def acc():
    a = CudaAccelerator()
    previous = torch.cuda.current_device()
    yield a
    torch.cuda.set_device(previous)


def test_auto_selection_picks_cuda(monkeypatch):
    monkeypatch.setattr(registry, "_accelerator", None)
    monkeypatch.delenv("MPICOMM_ACCELERATOR", raising=False)
    chosen = registry.get_accelerator()
    assert chosen.name == "cuda" and chosen.is_available()
    assert registry.get_accelerator() is chosen


def test_devices_and_names(acc):
    count = acc.device_count()
    assert count >= 1
    for i in range(count):
        acc.set_device(i)
        assert acc.current_device() == i and acc.current_device_name() == f"cuda:{i}"
        t = torch.ones(2, device=acc.current_device_name())
        assert t.device == torch.device("cuda", i) and acc.on_accelerator(t)
        assert acc.is_device_buffer(t)
    assert torch.ones(1, device=acc.device_name()).device.type == "cuda"
    with pytest.raises(ValueError, match="out of range"):
        acc.set_device(count)
    assert 0 <= acc.local_device_index() < count


def test_pinned_staging_buffers(acc):
    host = torch.arange(1000, dtype=torch.float32)
    pinned = acc.pin_memory(host)
    assert acc.is_pinned(pinned) and not acc.is_pinned(host) and pinned is not host
    assert torch.equal(pinned, host)
    assert acc.pin_memory(pinned) is pinned
    buf = acc.empty_host((4, 5), torch.bfloat16)
    assert buf.shape == (4, 5) and buf.dtype == torch.bfloat16 and acc.is_pinned(buf)
    assert not acc.is_pinned(acc.empty_host(3, torch.int8, pinned=False))
    assert not acc.is_device_buffer(buf)


def test_stream_synchronize_waits_for_queued_work(acc):
    x = torch.randn(2048, 2048, device="cuda")
    host = acc.empty_host(x.shape, x.dtype)
    done = acc.new_event()
    y = x @ x
    host.copy_(y, non_blocking=True)
    done.record()
    acc.stream_synchronize()
    assert done.query()
    torch.testing.assert_close(host, (x @ x).cpu(), rtol=1e-3, atol=1e-2)


def test_side_stream_and_timing_events(acc):
    side = acc.new_stream()
    start, end = acc.new_event(enable_timing=True), acc.new_event(enable_timing=True)
    with acc.stream(side):
        assert acc.current_stream() == side
        start.record()
        z = torch.ones(1 << 20, device="cuda").cumsum(0)
        end.record()
    acc.synchronize()
    assert start.elapsed_time(end) >= 0.0 and z[-1].item() == float(1 << 20)
    assert acc.memory_allocated() > 0 and acc.max_memory_allocated() >= acc.memory_allocated()
    assert acc.total_memory() > 2**30


def test_rng_reproducible(acc):
    acc.manual_seed(42)
    a = torch.randn(8, device="cuda")
    acc.manual_seed(42)
    b = torch.randn(8, device="cuda")
    assert torch.equal(a, b)
    state = acc.get_rng_state()
    c = torch.rand(4, device="cuda")
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), c)


def test_dtypes_work_on_the_device(acc):
    for dtype in acc.supported_dtypes():
        x = torch.ones(4, dtype=dtype, device="cuda")
        assert int((x + x).sum().item()) == (4 if dtype == torch.bool else 8), dtype


def test_cuda_aware_verdict_is_answerable(acc):
    verdict = acc.cuda_aware_verdict()
    assert verdict.value in (True, False, None) and verdict.source and verdict.reason
    assert acc.is_cuda_aware_mpi() is (verdict.value is True)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="cupy not installed")
def test_cupy_arrays_are_device_buffers(acc):
    import cupy

    assert acc.is_device_buffer(cupy.zeros(3)) and acc.has_cupy()
