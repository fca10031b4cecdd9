"""The one global accelerator: created lazily at the first get_accelerator(), replaceable."""
from __future__ import annotations

import os
import threading
from typing import Callable, Dict, Mapping, Optional, Tuple

from .abstract import Accelerator
from .cpu import CpuAccelerator
from .cuda import CudaAccelerator

#: Override variable for the accelerator choice.
ACCELERATOR_VAR = "MPICOMM_ACCELERATOR"

#: Known accelerators by name.
ACCELERATORS: Dict[str, Callable[[], Accelerator]] = {
    "cpu": CpuAccelerator,
    "cuda": CudaAccelerator,
}

_accelerator: Optional[Accelerator] = None
_lock = threading.Lock()


def _cuda_available() -> Tuple[bool, str]:
    # torch.cuda.is_available() creates no CUDA context; with PYTORCH_NVML_BASED_CUDA_CHECK=1 it
    # asks NVML instead of the CUDA runtime, which keeps a later fork() safe.
    try:
        import torch

        if torch.cuda.is_available():
            return True, "torch.cuda.is_available() is True"
        return False, "torch.cuda.is_available() is False"
    except Exception as exc:  # noqa: BLE001 - a broken CUDA set-up must not crash detection
        return False, f"torch.cuda.is_available() raised {type(exc).__name__}: {exc}"


def select_accelerator(env: Optional[Mapping[str, str]] = None) -> Accelerator:
    """Create the accelerator named by MPICOMM_ACCELERATOR, else "cuda" if usable, else "cpu"."""
    env = os.environ if env is None else env
    requested = env.get(ACCELERATOR_VAR, "").strip().lower()
    if requested:
        if requested not in ACCELERATORS:
            raise ValueError(f"{ACCELERATOR_VAR}={env[ACCELERATOR_VAR]!r} is not a known "
                             f"accelerator; expected one of: {', '.join(sorted(ACCELERATORS))}")
        acc = ACCELERATORS[requested]()
        if not acc.is_available():
            raise RuntimeError(f"{ACCELERATOR_VAR}={requested} but the {requested} accelerator "
                               "is not available in this process (for cuda: "
                               "torch.cuda.is_available() is False)")
        acc.selected_by = f"{ACCELERATOR_VAR}={requested}"
        return acc
    ok, why = _cuda_available()
    acc = CudaAccelerator() if ok else CpuAccelerator()
    acc.selected_by = f"auto: {why}"
    return acc


def get_accelerator() -> Accelerator:
    """The global accelerator, created at the first call (cheap afterwards)."""
    acc = _accelerator
    if acc is not None:
        return acc
    return _create()


def _create() -> Accelerator:
    global _accelerator
    with _lock:
        if _accelerator is None:
            _accelerator = select_accelerator()
        return _accelerator


def set_accelerator(acc: Optional[Accelerator]) -> None:
    """Install a custom accelerator as the global one (None: detect again at the next get)."""
    global _accelerator
    if acc is not None and not isinstance(acc, Accelerator):
        raise TypeError(f"set_accelerator expects an Accelerator instance or None, "
                        f"got {type(acc).__name__}")
    with _lock:
        if acc is not None and acc.selected_by == "constructed directly":
            acc.selected_by = "set_accelerator()"
        _accelerator = acc
