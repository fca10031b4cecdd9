"""The CUDA accelerator against a fake torch.cuda: every method reaches the right call."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from accelerators import CudaAccelerator, mpi_lib


class FakeStream:
    def __init__(self, device=None):
        self.device, self.synced = device, 0

    def synchronize(self):
        self.synced += 1


class FakeCuda:
    """Records calls; 4 devices, current device 1, capability (8, 0)."""

    def __init__(self, count=4, current=1, capability=(8, 0), bf16=True):
        self.calls = []
        self.count, self.current, self.capability, self.bf16 = count, current, capability, bf16
        self.streams = {}

    def install(self, monkeypatch):
        names = ["is_available", "device_count", "current_device", "set_device", "synchronize",
                 "current_stream", "Stream", "stream", "Event", "memory_allocated",
                 "max_memory_allocated", "empty_cache", "get_device_properties",
                 "is_bf16_supported", "get_device_capability", "manual_seed", "manual_seed_all",
                 "get_rng_state", "set_rng_state"]
        for name in names:
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        return self

    def _log(self, *call):
        self.calls.append(call)

    def is_available(self):
        return True

    def device_count(self):
        return self.count

    def current_device(self):
        return self.current

    def set_device(self, i):
        self._log("set_device", i)
        self.current = i

    def synchronize(self, device=None):
        self._log("synchronize", device)

    def current_stream(self, device=None):
        return self.streams.setdefault(device, FakeStream(device))

    def Stream(self, device=None):
        self._log("Stream", device)
        return FakeStream(device)

    def stream(self, s):
        self._log("stream", s)
        return "context"

    def Event(self, enable_timing=False):
        self._log("Event", enable_timing)
        return "event"

    def memory_allocated(self, device=None):
        return 111

    def max_memory_allocated(self, device=None):
        return 222

    def empty_cache(self):
        self._log("empty_cache")

    def get_device_properties(self, i):
        return types.SimpleNamespace(name=f"Fake GPU {i}", major=8, minor=0, total_memory=2**34)

    def is_bf16_supported(self):
        return self.bf16

    def get_device_capability(self, device=None):
        return self.capability

    def manual_seed(self, seed):
        self._log("manual_seed", seed)

    def manual_seed_all(self, seed):
        self._log("manual_seed_all", seed)

    def get_rng_state(self, device="cuda"):
        self._log("get_rng_state", device)
        return "state"

    def set_rng_state(self, state, device="cuda"):
        self._log("set_rng_state", state, device)


@pytest.fixture
def fake(monkeypatch):
    for var in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                "MPICOMM_LOCAL_RANK", "PMI_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
                "PALS_LOCAL_RANKID", "MPICOMM_CUDA_AWARE"):
        monkeypatch.delenv(var, raising=False)
    return FakeCuda().install(monkeypatch)


def test_device_names_and_selection(fake):
    acc = CudaAccelerator()
    assert acc.is_available() and acc.device_count() == 4
    assert acc.device_name() == "cuda" and acc.device_name(3) == "cuda:3"
    assert acc.current_device() == 1 and acc.current_device_name() == "cuda:1"
    assert acc.device(2) == torch.device("cuda", 2)
    acc.set_device(2)
    assert fake.calls == [("set_device", 2)] and acc.current_device_name() == "cuda:2"
    with pytest.raises(ValueError, match="cuda device index 4 out of range: 4 device"):
        acc.set_device(4)
    with pytest.raises(ValueError, match="int >= 0, got 'cuda:0'"):
        acc.device_name("cuda:0")
    assert fake.calls == [("set_device", 2)]


def test_local_device_is_local_rank_modulo_devices(fake, monkeypatch):
    monkeypatch.setenv("MPI_LOCALRANKID", "5")
    acc = CudaAccelerator()
    assert acc.local_device_index() == 1
    assert acc.set_local_device() == 1 and fake.calls == [("set_device", 1)]


def test_synchronize_whole_device_versus_current_stream(fake):
    acc = CudaAccelerator()
    acc.synchronize()
    acc.synchronize(3)
    assert fake.calls == [("synchronize", None), ("synchronize", 3)]
    acc.stream_synchronize(2)
    assert fake.streams[2].synced == 1 and ("synchronize", 2) not in fake.calls
    assert acc.current_stream(2) is fake.streams[2]
    stream = acc.new_stream(1)
    assert acc.stream(stream) == "context" and acc.new_event(enable_timing=True) == "event"
    assert fake.calls[-3:] == [("Stream", 1), ("stream", stream), ("Event", True)]


class FakeHostTensor:
    def __init__(self, pinned):
        self.pinned, self.copies = pinned, 0

    def is_pinned(self):
        return self.pinned

    def pin_memory(self):
        self.copies += 1
        return FakeHostTensor(True)


def test_pinned_memory(fake, monkeypatch):
    acc = CudaAccelerator()
    t = FakeHostTensor(False)
    pinned = acc.pin_memory(t)
    assert pinned is not t and acc.is_pinned(pinned) and not acc.is_pinned(t) and t.copies == 1
    assert acc.pin_memory(pinned) is pinned
    made = []
    monkeypatch.setattr(torch, "empty", lambda shape, dtype, pin_memory: made.append(
        (shape, dtype, pin_memory)) or "buffer")
    assert acc.empty_host((2, 3), torch.float16) == "buffer"
    acc.empty_host(7, torch.int8, pinned=False)
    assert made == [((2, 3), torch.float16, True), (7, torch.int8, False)]


def test_memory_figures(fake):
    acc = CudaAccelerator()
    assert acc.memory_allocated() == 111 and acc.max_memory_allocated(0) == 222
    assert acc.total_memory(0) == 2**34 and acc.total_memory() == 2**34
    acc.empty_cache()
    assert fake.calls == [("empty_cache",)]


def test_device_buffers(fake):
    acc = CudaAccelerator()
    cuda_tensor = types.SimpleNamespace(device=torch.device("cuda", 0))
    cupy_like = types.SimpleNamespace(__cuda_array_interface__={"shape": (2,)})
    assert acc.is_device_buffer(cuda_tensor) and acc.on_accelerator(cuda_tensor)
    assert acc.is_device_buffer(cupy_like)
    assert not acc.is_device_buffer(torch.ones(2)) and not acc.on_accelerator(torch.ones(2))
    assert not acc.is_device_buffer(np.ones(2))

    class Broken:
        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("array on a closed device")

    assert not acc.is_device_buffer(Broken())
    assert repr(acc) == "CudaAccelerator(name='cuda')"


@pytest.mark.parametrize("capability,bf16,fp16", [((8, 0), True, True), ((7, 0), False, True),
                                                  ((5, 2), False, False)])
def test_dtype_support(monkeypatch, capability, bf16, fp16):
    FakeCuda(capability=capability, bf16=bf16).install(monkeypatch)
    acc = CudaAccelerator()
    assert acc.is_bf16_supported() is bf16 and acc.is_fp16_supported() is fp16
    dtypes = acc.supported_dtypes()
    assert (torch.bfloat16 in dtypes) is bf16 and (torch.float16 in dtypes) is fp16
    assert torch.float32 in dtypes and torch.int64 in dtypes


def test_rng(fake):
    acc = CudaAccelerator()
    acc.manual_seed(5)
    acc.manual_seed_all(6)
    assert acc.get_rng_state() == "state"
    acc.set_rng_state("s", device=2)
    assert fake.calls == [("manual_seed", 5), ("manual_seed_all", 6),
                          ("get_rng_state", "cuda"), ("set_rng_state", "s", 2)]


def test_describe_lists_devices(fake):
    lines = dict(CudaAccelerator().describe())
    assert lines["device 3"].startswith("Fake GPU 3, capability 8.0, 16.0 GiB")
    assert "cupy" in lines


class FakeLib:
    def __init__(self, answer):
        self.answer, self.calls = answer, 0

    def MPIX_Query_cuda_support(self):
        self.calls += 1
        return self.answer


@pytest.mark.parametrize("answer,aware", [(1, True), (0, False)])
def test_verdict_uses_mpi_info_and_library_once(fake, monkeypatch, answer, aware):
    lib = FakeLib(answer)
    monkeypatch.setattr(mpi_lib, "world_info", lambda: {"mpi_memory_alloc_kinds": "mpi,system"})
    monkeypatch.setattr(mpi_lib, "mpi_library", lambda: lib)
    acc = CudaAccelerator()
    verdict = acc.cuda_aware_verdict()
    assert (verdict.value, verdict.source) == (aware, "MPIX_Query_cuda_support")
    assert acc.is_cuda_aware_mpi() is aware
    assert acc.cuda_aware_verdict() is verdict and lib.calls == 1


def test_unknown_verdict_means_not_cuda_aware(fake, monkeypatch):
    monkeypatch.setattr(mpi_lib, "world_info", lambda: None)
    monkeypatch.setattr(mpi_lib, "mpi_library", lambda: None)
    for var in ("MV2_USE_CUDA", "MPICH_GPU_SUPPORT_ENABLED", "OMPI_MCA_opal_cuda_support",
                "MPIR_CVAR_ENABLE_GPU"):
        monkeypatch.delenv(var, raising=False)
    acc = CudaAccelerator()
    assert acc.cuda_aware_verdict().value is None and acc.is_cuda_aware_mpi() is False


def test_verdict_override_and_bad_override(fake, monkeypatch):
    monkeypatch.setattr(mpi_lib, "world_info", lambda: None)
    monkeypatch.setattr(mpi_lib, "mpi_library", lambda: None)
    monkeypatch.setenv("MPICOMM_CUDA_AWARE", "1")
    assert CudaAccelerator().is_cuda_aware_mpi() is True
    monkeypatch.setenv("MPICOMM_CUDA_AWARE", "perhaps")
    with pytest.raises(ValueError, match="MPICOMM_CUDA_AWARE='perhaps': expected 0 or 1"):
        CudaAccelerator().cuda_aware_verdict()


def test_mpi_missing_gives_an_answer(fake, monkeypatch):
    def no_mpi():
        raise ImportError("No module named 'mpi4py'")

    monkeypatch.setattr(mpi_lib, "world_info", no_mpi)
    monkeypatch.setenv("MV2_USE_CUDA", "1")
    assert CudaAccelerator().cuda_aware_verdict().source == "MV2_USE_CUDA"
