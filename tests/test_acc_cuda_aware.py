"""CUDA-aware MPI verdict from fakes: override, MPI info, vendor query functions, env hints."""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses

import pytest
from mpi4py import MPI

from accelerators import CudaAwareVerdict, detect_cuda_aware
from accelerators.mpi_lib import mpi_library, pick_library_path, world_info


class FakeMpiLib:
    """An MPI library seen through ctypes: only the MPIX symbols given exist."""

    def __init__(self, gpu_query=None, gpu_rc=0, cuda_query=None, raises=None):
        self.calls = []
        if gpu_query is not None:
            def MPIX_GPU_query_support(gpu_type, out):
                self.calls.append(("MPIX_GPU_query_support", gpu_type))
                if raises:
                    raise raises
                out._obj.value = gpu_query
                return gpu_rc
            self.MPIX_GPU_query_support = MPIX_GPU_query_support
        if cuda_query is not None:
            def MPIX_Query_cuda_support():
                self.calls.append(("MPIX_Query_cuda_support",))
                return cuda_query
            self.MPIX_Query_cuda_support = MPIX_Query_cuda_support


def test_override_wins_over_everything():
    info = {"mpi_memory_alloc_kinds": "mpi,system,cuda"}
    lib = FakeMpiLib(gpu_query=1)
    got = detect_cuda_aware(env={"MPICOMM_CUDA_AWARE": "0", "MV2_USE_CUDA": "1"}, info=info,
                            lib=lib)
    assert got == CudaAwareVerdict(False, "MPICOMM_CUDA_AWARE", "set by MPICOMM_CUDA_AWARE=0")
    assert lib.calls == []
    assert detect_cuda_aware(env={"MPICOMM_CUDA_AWARE": "1"}).value is True


@pytest.mark.parametrize("text,value", [("true", True), ("YES", True), ("on", True),
                                        ("false", False), ("No", False), (" off ", False)])
def test_override_spellings(text, value):
    assert detect_cuda_aware(env={"MPICOMM_CUDA_AWARE": text}).value is value


@pytest.mark.parametrize("bad", ["2", "maybe", "cuda"])
def test_bad_override_is_an_error(bad):
    with pytest.raises(ValueError, match=f"MPICOMM_CUDA_AWARE='{bad}': expected 0 or 1"):
        detect_cuda_aware(env={"MPICOMM_CUDA_AWARE": bad})


def test_empty_override_counts_as_unset():
    assert detect_cuda_aware(env={"MPICOMM_CUDA_AWARE": ""}).value is None


@pytest.mark.parametrize("kinds", ["mpi,system,cuda", "system, CUDA:device", "cuda:device,mpi"])
def test_alloc_kinds_with_cuda_device_memory_is_yes(kinds):
    got = detect_cuda_aware(env={}, info={"mpi_memory_alloc_kinds": kinds},
                            lib=FakeMpiLib(gpu_query=0))
    assert (got.value, got.source) == (True, "mpi_memory_alloc_kinds")
    assert kinds in got.reason


@pytest.mark.parametrize("kinds", ["mpi,system", "mpi,system,cuda:host,cuda:managed"])
def test_alloc_kinds_without_device_memory_is_not_a_verdict(kinds):
    got = detect_cuda_aware(env={}, info={"mpi_memory_alloc_kinds": kinds}, lib=None)
    assert (got.value, got.source) == (None, "none")
    assert kinds in got.reason and "host memory" in got.reason


def test_real_mpi_info_object():
    info = MPI.Info.Create()
    try:
        info.Set("mpi_memory_alloc_kinds", "mpi,system,cuda")
        assert detect_cuda_aware(env={}, info=info).value is True
        info.Delete("mpi_memory_alloc_kinds")
        got = detect_cuda_aware(env={}, info=info)
        assert got.value is None and "no mpi_memory_alloc_kinds info key" in got.reason
    finally:
        info.Free()


@pytest.mark.parametrize("answer,value", [(1, True), (0, False)])
def test_mpich_gpu_query(answer, value):
    lib = FakeMpiLib(gpu_query=answer, cuda_query=1 - answer)
    got = detect_cuda_aware(env={}, info={"mpi_memory_alloc_kinds": "mpi,system"}, lib=lib)
    assert (got.value, got.source) == (value, "MPIX_GPU_query_support")
    assert lib.calls == [("MPIX_GPU_query_support", 0)]  # 0 is MPIX_GPU_SUPPORT_CUDA in mpi.h


@pytest.mark.parametrize("answer,value", [(1, True), (0, False)])
def test_open_mpi_cuda_query(answer, value):
    lib = FakeMpiLib(cuda_query=answer)
    got = detect_cuda_aware(env={}, info=None, lib=lib)
    assert (got.value, got.source) == (value, "MPIX_Query_cuda_support")


def test_gpu_query_error_code_falls_back_to_cuda_query():
    lib = FakeMpiLib(gpu_query=1, gpu_rc=13, cuda_query=0)
    got = detect_cuda_aware(env={}, lib=lib)
    assert (got.value, got.source) == (False, "MPIX_Query_cuda_support")


def test_gpu_query_that_raises_falls_back():
    lib = FakeMpiLib(gpu_query=1, raises=OSError("bad call"))
    got = detect_cuda_aware(env={"MV2_USE_CUDA": "1"}, lib=lib)
    assert (got.value, got.source) == (True, "MV2_USE_CUDA")
    lib2 = FakeMpiLib(gpu_query=1, raises=OSError("bad call"))
    got2 = detect_cuda_aware(env={}, lib=lib2)
    assert got2.value is None and "bad call" in got2.reason


def test_library_without_the_symbols_is_guarded():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))  # a real library with no MPIX functions
    got = detect_cuda_aware(env={}, info={}, lib=libc)
    assert got.value is None
    assert "no MPIX_GPU_query_support symbol" in got.reason
    assert "no MPIX_Query_cuda_support symbol" in got.reason


def test_vendor_query_beats_environment_hints():
    got = detect_cuda_aware(env={"OMPI_MCA_opal_cuda_support": "1"}, lib=FakeMpiLib(cuda_query=0))
    assert (got.value, got.source) == (False, "MPIX_Query_cuda_support")


@pytest.mark.parametrize("var,text,value", [
    ("MV2_USE_CUDA", "1", True),
    ("MV2_USE_CUDA", "0", False),
    ("MPICH_GPU_SUPPORT_ENABLED", "1", True),
    ("MPICH_GPU_SUPPORT_ENABLED", "0", False),
    ("OMPI_MCA_opal_cuda_support", "true", True),
    ("OMPI_MCA_opal_cuda_support", "0", False),
    ("MPIR_CVAR_ENABLE_GPU", "0", False),
])
def test_environment_hints(var, text, value):
    got = detect_cuda_aware(env={var: text}, info=None, lib=None)
    assert (got.value, got.source) == (value, var)


def test_hints_that_are_no_verdict():
    got = detect_cuda_aware(env={"MPIR_CVAR_ENABLE_GPU": "1", "MV2_USE_CUDA": "sometimes"})
    assert got.value is None
    assert "MPIR_CVAR_ENABLE_GPU=1 does not show CUDA support" in got.reason
    assert "ignored MV2_USE_CUDA='sometimes'" in got.reason


def test_nothing_known_is_unknown_and_means_staging():
    got = detect_cuda_aware(env={}, info=None, lib=None)
    assert (got.value, got.source, got.label) == (None, "none", "unknown")
    assert "staging device buffers through host memory" in got.reason


def test_verdict_is_frozen_and_labelled():
    verdict = CudaAwareVerdict(True, "x", "y")
    assert verdict.label == "yes" and CudaAwareVerdict(False, "x", "y").label == "no"
    with pytest.raises(dataclasses.FrozenInstanceError):
        verdict.value = False


def test_pick_library_path():
    paths = ["/usr/lib/libmpi_cxx.so.40", "/opt/lib/libmpifort.so.12", "/usr/lib/libc.so.6",
             "/opt/ompi/lib/libmpi.so.40.30.0", "/opt/mpich/lib/libmpi.so.12"]
    assert pick_library_path(paths) == "/opt/ompi/lib/libmpi.so.40.30.0"
    cray = "/opt/cray/lib/libmpi_cray.so.12"
    assert pick_library_path([cray]) == cray
    assert pick_library_path(["/usr/lib/libmpi_usempif08.so", "/x/libmpich.so"]) == "/x/libmpich.so"
    assert pick_library_path(["/usr/lib/libc.so.6"]) is None


def test_against_the_mpi_in_use():
    """The verdict for the real library agrees with calling its MPIX functions directly."""
    lib = mpi_library()
    assert lib is not None, "the MPI library loaded by mpi4py was not found"
    got = detect_cuda_aware(env={}, info=world_info(), lib=lib)
    kinds = (world_info() or {}).get("mpi_memory_alloc_kinds", "")
    if "cuda" in kinds.replace("cuda:host", "").replace("cuda:managed", ""):
        assert got.source == "mpi_memory_alloc_kinds"
    elif hasattr(lib, "MPIX_GPU_query_support"):
        flag = ctypes.c_int(-1)
        assert lib.MPIX_GPU_query_support(0, ctypes.byref(flag)) == 0
        assert (got.value, got.source) == (bool(flag.value), "MPIX_GPU_query_support")
    elif hasattr(lib, "MPIX_Query_cuda_support"):
        assert (got.value, got.source) == (bool(lib.MPIX_Query_cuda_support()),
                                           "MPIX_Query_cuda_support")
    else:
        assert got.source in ("none", "MV2_USE_CUDA", "MPICH_GPU_SUPPORT_ENABLED",
                              "OMPI_MCA_opal_cuda_support", "MPIR_CVAR_ENABLE_GPU")


class OldStyleInfo:
    """mpi4py 3's Info.Get returned (value, flag)."""

    def __init__(self, items):
        self.items = items

    def Get(self, key):
        return (self.items[key], True) if key in self.items else (None, False)


def test_info_objects_returning_value_and_flag():
    assert detect_cuda_aware(env={}, info=OldStyleInfo({"mpi_memory_alloc_kinds": "cuda"})).value
    got = detect_cuda_aware(env={}, info=OldStyleInfo({}))
    assert got.value is None and "no mpi_memory_alloc_kinds info key" in got.reason


def test_cuda_query_that_raises_is_unknown():
    class Lib:
        def MPIX_Query_cuda_support(self):
            raise OSError("segv avoided")

    got = detect_cuda_aware(env={}, lib=Lib())
    assert got.value is None
    assert "MPIX_Query_cuda_support raised OSError: segv avoided" in got.reason
