"""The CUDA accelerator, through torch.cuda (cupy is optional and never required)."""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional, Sequence, Tuple

from .abstract import Accelerator
from .cuda_aware import CudaAwareVerdict, detect_cuda_aware


def _cuda() -> Any:
    import torch

    return torch.cuda


class CudaAccelerator(Accelerator):
    """NVIDIA GPUs through torch.cuda. Nothing here runs at import or construction time."""

    name = "cuda"

    def is_available(self) -> bool:
        """torch.cuda.is_available()."""
        return bool(_cuda().is_available())

    def device_count(self) -> int:
        """torch.cuda.device_count()."""
        return int(_cuda().device_count())

    def current_device(self) -> int:
        """torch.cuda.current_device()."""
        return int(_cuda().current_device())

    def set_device(self, index: int) -> None:
        """torch.cuda.set_device after a range check."""
        self._check_in_range(index)
        _cuda().set_device(index)

    def is_device_buffer(self, obj: Any) -> bool:
        """True for CUDA torch tensors and for arrays exposing __cuda_array_interface__ (cupy)."""
        device = getattr(obj, "device", None)
        if getattr(device, "type", None) == "cuda":
            return True
        try:
            return hasattr(obj, "__cuda_array_interface__")
        except Exception:  # noqa: BLE001 - a property that raises is not a device buffer
            return False

    def synchronize(self, device: Optional[int] = None) -> None:
        """torch.cuda.synchronize: all streams of the device."""
        _cuda().synchronize(device)

    def current_stream(self, device: Optional[int] = None) -> Any:
        """torch.cuda.current_stream."""
        return _cuda().current_stream(device)

    def stream_synchronize(self, device: Optional[int] = None) -> None:
        """Wait for the current stream of the device only."""
        _cuda().current_stream(device).synchronize()

    def new_stream(self, device: Optional[int] = None) -> Any:
        """torch.cuda.Stream."""
        return _cuda().Stream(device=device)

    def stream(self, stream: Any) -> Any:
        """torch.cuda.stream context."""
        return _cuda().stream(stream)

    def new_event(self, enable_timing: bool = False) -> Any:
        """torch.cuda.Event."""
        return _cuda().Event(enable_timing=enable_timing)

    def pin_memory(self, tensor: Any) -> Any:
        """A page-locked copy of a host tensor (the tensor itself if already pinned)."""
        if tensor.is_pinned():
            return tensor
        return tensor.pin_memory()

    def is_pinned(self, tensor: Any) -> bool:
        """tensor.is_pinned()."""
        return bool(tensor.is_pinned())

    def empty_host(self, shape: Sequence[int] | int, dtype: Any, pinned: bool = True) -> Any:
        """A host tensor, page-locked when ``pinned``."""
        import torch

        return torch.empty(shape, dtype=dtype, pin_memory=bool(pinned))

    def memory_allocated(self, device: Optional[int] = None) -> int:
        """torch.cuda.memory_allocated."""
        return int(_cuda().memory_allocated(device))

    def max_memory_allocated(self, device: Optional[int] = None) -> int:
        """torch.cuda.max_memory_allocated."""
        return int(_cuda().max_memory_allocated(device))

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache."""
        _cuda().empty_cache()

    def total_memory(self, device: Optional[int] = None) -> int:
        """Device memory in bytes."""
        cuda = _cuda()
        index = cuda.current_device() if device is None else device
        return int(cuda.get_device_properties(index).total_memory)

    def is_bf16_supported(self) -> bool:
        """torch.cuda.is_bf16_supported()."""
        return bool(_cuda().is_bf16_supported())

    def is_fp16_supported(self) -> bool:
        """float16 needs compute capability 5.3 or later."""
        cuda = _cuda()
        return tuple(cuda.get_device_capability()) >= (5, 3)

    def manual_seed(self, seed: int) -> None:
        """torch.cuda.manual_seed: the current device's generator."""
        _cuda().manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        """torch.cuda.manual_seed_all."""
        _cuda().manual_seed_all(int(seed))

    def get_rng_state(self, device: Optional[int] = None) -> Any:
        """torch.cuda.get_rng_state."""
        return _cuda().get_rng_state("cuda" if device is None else device)

    def set_rng_state(self, state: Any, device: Optional[int] = None) -> None:
        """torch.cuda.set_rng_state."""
        _cuda().set_rng_state(state, "cuda" if device is None else device)

    @staticmethod
    def has_cupy() -> bool:
        """Whether cupy is installed (not imported)."""
        return importlib.util.find_spec("cupy") is not None

    def _detect_cuda_aware(self) -> CudaAwareVerdict:
        from . import mpi_lib

        info = lib = None
        try:
            info = mpi_lib.world_info()
            lib = mpi_lib.mpi_library()
        except ImportError:
            pass
        return detect_cuda_aware(env=os.environ, info=info, lib=lib)

    def describe(self) -> Tuple[Tuple[str, str], ...]:
        """Visible devices with name, capability and memory; cupy presence."""
        cuda = _cuda()
        lines = []
        for i in range(self.device_count()):
            props = cuda.get_device_properties(i)
            lines.append((f"device {i}", f"{props.name}, capability {props.major}.{props.minor}, "
                                         f"{props.total_memory / 2**30:.1f} GiB"))
        lines.append(("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")))
        lines.append(("cupy", "installed" if self.has_cupy() else "not installed (optional)"))
        return tuple(lines)
