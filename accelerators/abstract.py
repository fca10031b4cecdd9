"""The Accelerator interface: everything device-specific that a communication library needs."""
from __future__ import annotations

import abc
import threading
import warnings
from typing import Any, Optional, Sequence, Tuple

from .cuda_aware import CudaAwareVerdict
from .local_rank import LocalRank, detect_local_rank


class LocalRankWarning(UserWarning):
    """Local rank sources disagree or a launcher variable was unusable."""


class Accelerator(abc.ABC):
    """One kind of device (CPU, CUDA, ...): devices, streams, memory, dtypes, RNG, communication.

    Code outside this package asks the accelerator instead of branching on the device type.
    Creating an accelerator must not initialise the device runtime.

    The abstract methods below repeat one shape (decorator, signature, docstring) on purpose:
    each is a separate part of the interface that every accelerator implements, documented
    where it is declared.
    """

    #: Short device type name, as used in torch device strings ("cpu", "cuda").
    name: str = ""

    def __init__(self, local_rank: Optional[int] = None) -> None:
        if local_rank is not None and (isinstance(local_rank, bool)
                                       or not isinstance(local_rank, int) or local_rank < 0):
            raise ValueError(f"local_rank must be an int >= 0 or None, got {local_rank!r}")
        self._explicit_local_rank = local_rank
        self._local_rank: Optional[LocalRank] = None
        self._verdict: Optional[CudaAwareVerdict] = None
        self._lock = threading.Lock()
        #: How this accelerator was chosen (set by get_accelerator).
        self.selected_by: str = "constructed directly"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    # ---- devices -------------------------------------------------------------------------
    @abc.abstractmethod
    def is_available(self) -> bool:
        """Whether this kind of device can be used in this process."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of devices visible to this process."""

    @abc.abstractmethod
    def current_device(self) -> int:
        """Index of the current device."""

    @abc.abstractmethod
    def set_device(self, index: int) -> None:
        """Make device ``index`` current."""

    def device_name(self, i: Optional[int] = None) -> str:
        """Torch device string: the bare type ("cuda") for None, else "cuda:i"."""
        if i is None:
            return self.name
        self._check_index(i)
        return f"{self.name}:{i}"

    def current_device_name(self) -> str:
        """Torch device string of the current device ("cuda:0")."""
        return self.device_name(self.current_device())

    def device(self, i: Optional[int] = None) -> Any:
        """torch.device for ``device_name(i)``."""
        import torch

        return torch.device(self.device_name(i))

    def on_accelerator(self, tensor: Any) -> bool:
        """Whether a torch tensor lives on this accelerator's device type."""
        device = getattr(tensor, "device", None)
        return getattr(device, "type", None) == self.name

    @abc.abstractmethod
    def is_device_buffer(self, obj: Any) -> bool:
        """Whether ``obj`` (torch tensor, numpy or cupy array) is in device (not host) memory."""

    def _check_index(self, i: Any) -> None:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"{self.name} device index must be an int >= 0, got {i!r}")

    def _check_in_range(self, i: Any) -> None:
        self._check_index(i)
        count = self.device_count()
        if i >= count:
            raise ValueError(f"{self.name} device index {i} out of range: "
                             f"{count} device(s) visible")

    # ---- streams and events --------------------------------------------------------------
    @abc.abstractmethod
    def synchronize(self, device: Optional[int] = None) -> None:
        """Wait for all work on the device."""

    @abc.abstractmethod
    def current_stream(self, device: Optional[int] = None) -> Any:
        """The current stream of the device."""

    @abc.abstractmethod
    def stream_synchronize(self, device: Optional[int] = None) -> None:
        """Wait for the work queued on the current stream only."""

    @abc.abstractmethod
    def new_stream(self, device: Optional[int] = None) -> Any:
        """A new stream on the device."""

    @abc.abstractmethod
    def stream(self, stream: Any) -> Any:
        """Context manager that makes ``stream`` current."""

    @abc.abstractmethod
    def new_event(self, enable_timing: bool = False) -> Any:
        """A new event (record, wait, query, synchronize, elapsed_time)."""

    # ---- memory ----------------------------------------------------------------------------
    @abc.abstractmethod
    def pin_memory(self, tensor: Any) -> Any:
        """A page-locked copy of a host tensor where the device supports it, else the tensor."""

    @abc.abstractmethod
    def is_pinned(self, tensor: Any) -> bool:
        """Whether a host tensor is page-locked."""

    @abc.abstractmethod
    def empty_host(self, shape: Sequence[int] | int, dtype: Any, pinned: bool = True) -> Any:
        """An uninitialised host tensor for staging (page-locked where possible and asked for)."""

    @abc.abstractmethod
    def memory_allocated(self, device: Optional[int] = None) -> int:
        """Bytes currently allocated by torch on the device (0 where not tracked)."""

    @abc.abstractmethod
    def max_memory_allocated(self, device: Optional[int] = None) -> int:
        """Peak bytes allocated by torch on the device (0 where not tracked)."""

    @abc.abstractmethod
    def empty_cache(self) -> None:
        """Release cached, unused device memory."""

    # ---- dtypes ----------------------------------------------------------------------------
    @abc.abstractmethod
    def is_bf16_supported(self) -> bool:
        """Whether bfloat16 arithmetic works on the device."""

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool:
        """Whether float16 arithmetic works on the device."""

    def supported_dtypes(self) -> list:
        """The torch dtypes this device computes with."""
        import torch

        dtypes = [torch.float32, torch.float64]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        dtypes += [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]
        return dtypes

    # ---- random numbers ----------------------------------------------------------------------
    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the generator of the current device."""

    @abc.abstractmethod
    def manual_seed_all(self, seed: int) -> None:
        """Seed the generators of all devices."""

    @abc.abstractmethod
    def get_rng_state(self, device: Optional[int] = None) -> Any:
        """The generator state of the device (a ByteTensor)."""

    @abc.abstractmethod
    def set_rng_state(self, state: Any, device: Optional[int] = None) -> None:
        """Restore a generator state from get_rng_state."""

    # ---- communication ---------------------------------------------------------------------------
    def communication_backend_name(self) -> str:
        """Name of the communication backend: always "mpi"."""
        return "mpi"

    def local_rank(self) -> LocalRank:
        """This process's rank on its node and where that came from (cached after the first call).

        When no launcher variable is set this falls back to an MPI split, which is collective.
        """
        result = self._local_rank
        if result is None:
            with self._lock:
                if self._local_rank is None:
                    self._local_rank = self._detect_local_rank()
                    for message in self._local_rank.warnings:
                        warnings.warn(message, LocalRankWarning, stacklevel=3)
                result = self._local_rank
        return result

    def _detect_local_rank(self) -> LocalRank:
        return detect_local_rank(explicit=self._explicit_local_rank)

    def set_local_rank(self, rank: Optional[int]) -> None:
        """Set the local rank explicitly (None: detect again at the next local_rank())."""
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ValueError(f"local rank must be an int >= 0 or None, got {rank!r}")
        with self._lock:
            self._explicit_local_rank = rank
            self._local_rank = None

    def local_device_index(self) -> int:
        """Device for this rank: local rank modulo the visible devices."""
        return self.local_rank().device_index(max(1, self.device_count()))

    def set_local_device(self) -> int:
        """Make this rank's device (local_device_index) current and return its index."""
        index = self.local_device_index()
        self.set_device(index)
        return index

    def cuda_aware_verdict(self) -> CudaAwareVerdict:
        """Whether MPI takes this device's buffers directly, with its source (cached)."""
        result = self._verdict
        if result is None:
            with self._lock:
                if self._verdict is None:
                    self._verdict = self._detect_cuda_aware()
                result = self._verdict
        return result

    @abc.abstractmethod
    def _detect_cuda_aware(self) -> CudaAwareVerdict:
        """Compute the verdict (called once)."""

    def is_cuda_aware_mpi(self) -> bool:
        """True only when MPI is definitely CUDA-aware; unknown counts as False (stage on host)."""
        return self.cuda_aware_verdict().value is True

    def describe(self) -> Tuple[Tuple[str, str], ...]:
        """Extra (label, value) lines for the diagnosis."""
        return ()
