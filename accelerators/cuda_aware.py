"""CUDA-aware MPI verdict: yes, no or unknown, with the source that decided it."""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

from .flags import parse_flag

#: Our own override, read first.
OVERRIDE_VAR = "MPICOMM_CUDA_AWARE"
#: The MPI 4.1 info key on COMM_WORLD that lists the memory kinds MPI accepts.
ALLOC_KINDS_KEY = "mpi_memory_alloc_kinds"
#: Kinds in mpi_memory_alloc_kinds that mean device buffers can go straight to MPI.
DEVICE_KINDS = frozenset({"cuda", "cuda:device"})

#: Vendor environment hints, in order: (variable, MPI library that reads it, whether a true
#: value means yes). MPIR_CVAR_ENABLE_GPU=1 is MPICH's default, so only its 0 is a verdict.
ENV_HINTS: Tuple[Tuple[str, str, bool], ...] = (
    ("MV2_USE_CUDA", "MVAPICH2-GDR", True),
    ("MPICH_GPU_SUPPORT_ENABLED", "Cray MPICH", True),
    ("OMPI_MCA_opal_cuda_support", "Open MPI", True),
    ("MPIR_CVAR_ENABLE_GPU", "MPICH", False),
)

#: MPICH's MPIX_GPU_SUPPORT_CUDA constant.
_MPIX_GPU_SUPPORT_CUDA = 0


@dataclass(frozen=True)
class CudaAwareVerdict:
    """Whether MPI takes CUDA device buffers: ``value`` True/False, or None for unknown."""

    value: Optional[bool]
    source: str
    reason: str

    @property
    def label(self) -> str:
        """'yes', 'no' or 'unknown'."""
        return {True: "yes", False: "no", None: "unknown"}[self.value]


def _info_get(info: Any, key: str) -> Optional[str]:
    """Read ``key`` from a mapping or an mpi4py Info object (None when absent)."""
    if info is None:
        return None
    if isinstance(info, Mapping):
        value = info.get(key)
    else:
        value = info.Get(key)
        if isinstance(value, tuple):  # mpi4py 3 returned (value, flag)
            value = value[0] if value[1] else None
    return None if value is None else str(value)


def _symbol(lib: Any, name: str) -> Any:
    if lib is None:
        return None
    try:
        return getattr(lib, name)
    except (AttributeError, OSError):
        return None


def _declare(fn: Any, argtypes: list, restype: Any) -> None:
    """Give a ctypes function its C signature (fakes without these attributes are left alone)."""
    try:
        fn.argtypes = argtypes
        fn.restype = restype
    except AttributeError:
        pass


def query_vendor(lib: Any) -> Tuple[Optional[bool], str, str]:
    """Ask the MPI library through its MPIX query functions; (None, ..) when it has none."""
    fn = _symbol(lib, "MPIX_GPU_query_support")  # MPICH >= 4
    if fn is not None:
        try:
            _declare(fn, [ctypes.c_int, ctypes.POINTER(ctypes.c_int)], ctypes.c_int)
            out = ctypes.c_int(0)
            rc = fn(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(out))
        except Exception as exc:  # noqa: BLE001 - reported, next query tried
            note = f"MPIX_GPU_query_support raised {type(exc).__name__}: {exc}"
        else:
            if rc == 0:
                value = bool(out.value)
                return value, "MPIX_GPU_query_support", (
                    f"MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) returned {int(out.value)}")
            note = f"MPIX_GPU_query_support returned error code {rc}"
    else:
        note = "no MPIX_GPU_query_support symbol"
    fn = _symbol(lib, "MPIX_Query_cuda_support")  # Open MPI, MPICH
    if fn is not None:
        try:
            _declare(fn, [], ctypes.c_int)
            result = int(fn())
        except Exception as exc:  # noqa: BLE001
            return None, "", f"{note}; MPIX_Query_cuda_support raised {type(exc).__name__}: {exc}"
        return bool(result), "MPIX_Query_cuda_support", (
            f"MPIX_Query_cuda_support() returned {result}")
    return None, "", f"{note}; no MPIX_Query_cuda_support symbol"


def detect_cuda_aware(
    env: Optional[Mapping[str, str]] = None,
    info: Any = None,
    lib: Any = None,
) -> CudaAwareVerdict:
    """Decide whether MPI is CUDA-aware from the override, MPI info, vendor queries and env hints.

    ``env`` defaults to os.environ; ``info`` is a mapping or MPI.Info (COMM_WORLD's info);
    ``lib`` is the MPI library (ctypes.CDLL or a fake with the MPIX functions as attributes).
    Unknown (value None) means: stage device buffers through host memory.
    """
    env = os.environ if env is None else env
    seen: list[str] = []

    override = env.get(OVERRIDE_VAR, "").strip()
    if override:
        value = parse_flag(override)
        if value is None:
            raise ValueError(f"{OVERRIDE_VAR}={override!r}: expected 0 or 1 "
                             "(also accepted: true/false, yes/no, on/off)")
        return CudaAwareVerdict(value, OVERRIDE_VAR, f"set by {OVERRIDE_VAR}={override}")

    kinds_text = _info_get(info, ALLOC_KINDS_KEY)
    if kinds_text is None:
        seen.append(f"no {ALLOC_KINDS_KEY} info key" if info is not None else "no MPI info")
    else:
        kinds = {k.strip().lower() for k in kinds_text.split(",") if k.strip()}
        if kinds & DEVICE_KINDS:
            return CudaAwareVerdict(True, ALLOC_KINDS_KEY,
                                    f"{ALLOC_KINDS_KEY}={kinds_text!r} includes CUDA device memory")
        # Absent cuda only means it was not requested or not supported: keep looking.
        seen.append(f"{ALLOC_KINDS_KEY}={kinds_text!r} lists no CUDA device memory")

    if lib is None:
        seen.append("MPI library not available to ctypes")
    else:
        value, source, reason = query_vendor(lib)
        if value is not None:
            return CudaAwareVerdict(value, source, reason)
        seen.append(reason)

    for var, vendor, can_say_yes in ENV_HINTS:
        text = env.get(var)
        if text is None or not text.strip():
            continue
        value = parse_flag(text)
        if value is None:
            seen.append(f"ignored {var}={text!r} (not a boolean)")
            continue
        if value and not can_say_yes:
            seen.append(f"{var}={text.strip()} does not show CUDA support")
            continue
        return CudaAwareVerdict(value, var, f"{var}={text.strip()} ({vendor} environment hint)")
    seen.append("no vendor environment hint")

    return CudaAwareVerdict(None, "none",
                            "; ".join(seen) + ": staging device buffers through host memory")
