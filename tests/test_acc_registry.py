"""The global accelerator: lazy auto-selection, MPICOMM_ACCELERATOR override, set_accelerator."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import accelerators
from accelerators import (
    Accelerator,
    CpuAccelerator,
    CudaAccelerator,
    get_accelerator,
    registry,
    set_accelerator,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fresh(monkeypatch):
    """No global accelerator yet and no override; the previous global comes back afterwards."""
    monkeypatch.setattr(registry, "_accelerator", None)
    monkeypatch.delenv("MPICOMM_ACCELERATOR", raising=False)
    return monkeypatch


def _count_is_available(monkeypatch, result):
    calls = []

    def fake():
        calls.append(1)
        if isinstance(result, Exception):
            raise result
        return result

    monkeypatch.setattr(torch.cuda, "is_available", fake)
    return calls


def test_auto_picks_cpu_without_cuda_and_only_once(fresh):
    calls = _count_is_available(fresh, False)
    acc = get_accelerator()
    assert isinstance(acc, CpuAccelerator) and acc.name == "cpu"
    assert acc.selected_by == "auto: torch.cuda.is_available() is False"
    assert get_accelerator() is acc and get_accelerator() is acc
    assert len(calls) == 1, "detection must run once, at the first get_accelerator()"


def test_auto_picks_cuda_when_available(fresh):
    _count_is_available(fresh, True)
    acc = get_accelerator()
    assert isinstance(acc, CudaAccelerator) and acc.name == "cuda"
    assert acc.communication_backend_name() == "mpi"


def test_broken_cuda_setup_does_not_crash_detection(fresh):
    _count_is_available(fresh, RuntimeError("driver too old"))
    acc = get_accelerator()
    assert acc.name == "cpu" and "driver too old" in acc.selected_by


def test_override_cpu_even_with_cuda(fresh):
    _count_is_available(fresh, True)
    fresh.setenv("MPICOMM_ACCELERATOR", "cpu")
    acc = get_accelerator()
    assert acc.name == "cpu" and acc.selected_by == "MPICOMM_ACCELERATOR=cpu"


def test_override_cuda_is_case_insensitive(fresh):
    _count_is_available(fresh, True)
    fresh.setenv("MPICOMM_ACCELERATOR", " CUDA ")
    assert get_accelerator().name == "cuda"


def test_override_cuda_without_cuda_is_a_clear_error(fresh):
    _count_is_available(fresh, False)
    fresh.setenv("MPICOMM_ACCELERATOR", "cuda")
    with pytest.raises(RuntimeError, match="MPICOMM_ACCELERATOR=cuda but .* not available"):
        get_accelerator()
    fresh.setenv("MPICOMM_ACCELERATOR", "cpu")  # the failure was not kept: a corrected setting works
    assert get_accelerator().name == "cpu"


@pytest.mark.parametrize("bad", ["xpu", "gpu", "cpu0"])
def test_unknown_override_lists_valid_names(fresh, bad):
    fresh.setenv("MPICOMM_ACCELERATOR", bad)
    expected = f"MPICOMM_ACCELERATOR='{bad}' .* expected one of: cpu, cuda"
    with pytest.raises(ValueError, match=expected):
        get_accelerator()


def test_empty_override_means_auto(fresh):
    _count_is_available(fresh, False)
    fresh.setenv("MPICOMM_ACCELERATOR", "")
    assert get_accelerator().name == "cpu"


class RecordingAccelerator(CpuAccelerator):
    """A custom accelerator: the base class is enough to plug in a new device."""

    name = "custom"


def test_set_accelerator_installs_a_custom_one_and_none_resets(fresh):
    calls = _count_is_available(fresh, False)
    custom = RecordingAccelerator()
    set_accelerator(custom)
    assert get_accelerator() is custom and custom.selected_by == "set_accelerator()"
    assert get_accelerator().name == "custom"
    assert calls == []
    set_accelerator(None)
    again = get_accelerator()
    assert again is not custom and again.name == "cpu" and len(calls) == 1


@pytest.mark.parametrize("bad", ["cpu", CpuAccelerator, 3])
def test_set_accelerator_rejects_non_accelerators(fresh, bad):
    with pytest.raises(TypeError, match="expects an Accelerator instance or None, got"):
        set_accelerator(bad)


def test_abstract_base_cannot_be_instantiated():
    with pytest.raises(TypeError):
        Accelerator()


def test_public_names():
    expected = {"get_accelerator", "set_accelerator", "Accelerator", "CpuAccelerator",
                "CudaAccelerator", "LocalRank", "CudaAwareVerdict"}
    assert expected <= set(accelerators.__all__)
    for name in accelerators.__all__:
        assert hasattr(accelerators, name), name


def test_import_never_touches_cuda_or_mpi():
    """Importing (and constructing accelerators) calls no torch.cuda function and no MPI."""
    script = textwrap.dedent("""
        import sys
        import torch
        touched = []
        def trap(name):
            def f(*a, **k):
                touched.append(name)
                raise RuntimeError("CUDA touched: " + name)
            return f
        for name in ("is_available", "device_count", "current_device", "init", "_lazy_init",
                     "set_device", "synchronize", "get_device_properties", "is_bf16_supported"):
            setattr(torch.cuda, name, trap(name))
        import accelerators
        accelerators.CudaAccelerator()
        accelerators.CpuAccelerator()
        assert touched == [], touched
        assert not torch.cuda.is_initialized()
        assert "mpi4py.MPI" not in sys.modules, "importing accelerators initialised MPI"
        print("OK")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI_", "OMPI_"))}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
