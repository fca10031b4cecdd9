"""The CPU accelerator: one host "device", no streams, no pinned memory, plain torch RNG."""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator, Optional, Sequence

from .abstract import Accelerator
from .cuda_aware import CudaAwareVerdict


class CpuStream:
    """Stand-in stream: CPU work is synchronous, so there is never anything to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def wait_stream(self, other: Any) -> None:
        """Nothing to order."""

    def wait_event(self, event: Any) -> None:
        """Nothing to order."""


class CpuEvent:
    """Stand-in event: records the wall-clock time, so elapsed_time works as on CUDA (ms)."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self._time: Optional[float] = None

    def record(self, stream: Any = None) -> None:
        """Take the current time."""
        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        """Nothing to order."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def elapsed_time(self, end: "CpuEvent") -> float:
        """Milliseconds from this event's record to ``end``'s."""
        if not self.enable_timing or not end.enable_timing:
            raise RuntimeError("elapsed_time needs both events created with enable_timing=True")
        if self._time is None or end._time is None:
            raise RuntimeError("elapsed_time needs both events recorded first")
        return (end._time - self._time) * 1e3


class CpuAccelerator(Accelerator):
    """Host memory and the torch CPU generator; MPI always gets host buffers."""

    name = "cpu"

    def __init__(self, local_rank: Optional[int] = None) -> None:
        super().__init__(local_rank)
        self._stream = CpuStream()

    def is_available(self) -> bool:
        """Always available."""
        return True

    def device_count(self) -> int:
        """One host device."""
        return 1

    def current_device(self) -> int:
        """Always 0."""
        return 0

    def set_device(self, index: int) -> None:
        """Accept only index 0."""
        self._check_in_range(index)

    def device_name(self, i: Optional[int] = None) -> str:
        """Always "cpu" (torch tensors on the host carry no index)."""
        if i is not None:
            self._check_in_range(i)
        return "cpu"

    def is_device_buffer(self, obj: Any) -> bool:
        """Never: all CPU buffers are host memory."""
        return False

    def synchronize(self, device: Optional[int] = None) -> None:
        """Nothing to wait for."""

    def current_stream(self, device: Optional[int] = None) -> CpuStream:
        """The stand-in stream."""
        return self._stream

    def stream_synchronize(self, device: Optional[int] = None) -> None:
        """Nothing to wait for."""

    def new_stream(self, device: Optional[int] = None) -> CpuStream:
        """A stand-in stream."""
        return CpuStream()

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[Any]:
        """No-op context."""
        yield stream

    def new_event(self, enable_timing: bool = False) -> CpuEvent:
        """A stand-in event."""
        return CpuEvent(enable_timing)

    def pin_memory(self, tensor: Any) -> Any:
        """The tensor itself: the CPU accelerator never pins."""
        return tensor

    def is_pinned(self, tensor: Any) -> bool:
        """Always False: the CPU accelerator never pins (and never touches CUDA to ask)."""
        return False

    def empty_host(self, shape: Sequence[int] | int, dtype: Any, pinned: bool = True) -> Any:
        """torch.empty on the host; ``pinned`` is ignored."""
        import torch

        return torch.empty(shape, dtype=dtype)

    def memory_allocated(self, device: Optional[int] = None) -> int:
        """Not tracked: 0."""
        return 0

    def max_memory_allocated(self, device: Optional[int] = None) -> int:
        """Not tracked: 0."""
        return 0

    def empty_cache(self) -> None:
        """Nothing cached."""

    def total_memory(self) -> int:
        """Physical host memory in bytes."""
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def is_bf16_supported(self) -> bool:
        """torch computes in bfloat16 on the CPU."""
        return True

    def is_fp16_supported(self) -> bool:
        """torch computes in float16 on the CPU."""
        return True

    def manual_seed(self, seed: int) -> None:
        """Seed the CPU generator."""
        import torch

        torch.random.default_generator.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        """Same as manual_seed: there is one generator."""
        self.manual_seed(seed)

    def get_rng_state(self, device: Optional[int] = None) -> Any:
        """The CPU generator state."""
        import torch

        return torch.random.default_generator.get_state()

    def set_rng_state(self, state: Any, device: Optional[int] = None) -> None:
        """Restore the CPU generator state."""
        import torch

        torch.random.default_generator.set_state(state)

    def _detect_cuda_aware(self) -> CudaAwareVerdict:
        return CudaAwareVerdict(False, "cpu accelerator",
                                "the cpu accelerator hands MPI host buffers only")
