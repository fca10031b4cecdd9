"""Device buffers: straight to MPI when it is CUDA-aware for the operation, else staged through host memory."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

# Non-blocking reductions that some CUDA-aware MPI libraries still cannot take device buffers for
# (Open MPI's CUDA support covers blocking collectives; its non-blocking reductions need host memory).
_NONBLOCKING_REDUCTIONS = ("iallreduce", "ireduce_scatter_block", "ireduce")
_VENDOR_EXCEPTIONS = {"Open MPI": {name: False for name in _NONBLOCKING_REDUCTIONS}}


def parse_overrides(text: str) -> dict[str, bool]:
    """Parse MPICOMM_CUDA_AWARE_OPS, e.g. "iallreduce=0,alltoall=1"."""
    table: dict[str, bool] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or value.strip() not in ("0", "1"):
            raise ValueError(f"MPICOMM_CUDA_AWARE_OPS: expected entries like 'iallreduce=0', got {item!r}")
        table[name.strip().lower()] = value.strip() == "1"
    return table


@dataclass
class DevicePolicy:
    """Per-operation answer to "may this MPI call take device buffers directly?"."""

    cuda_aware: bool | None
    reason: str = ""
    table: dict[str, bool] = field(default_factory=dict)

    def direct(self, mpi_call: str) -> bool:
        """Whether device buffers go straight to ``mpi_call`` (e.g. "allreduce", "iallreduce")."""
        if not self.cuda_aware:
            return False
        return self.table.get(mpi_call, True)

    @classmethod
    def detect(cls) -> "DevicePolicy":
        """Build the policy from the accelerator's verdict, the MPI vendor and MPICOMM_CUDA_AWARE_OPS."""
        from mpi4py import MPI

        from accelerators import get_accelerator

        verdict = get_accelerator().cuda_aware_verdict()
        table = dict(_VENDOR_EXCEPTIONS.get(MPI.get_vendor()[0], {}))
        table.update(parse_overrides(os.environ.get("MPICOMM_CUDA_AWARE_OPS", "")))
        return cls(verdict.value, f"{verdict.source}: {verdict.reason}", table)


class StagingPool:
    """Reusable (pinned) host buffers for staging device data, by power-of-two size class."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def acquire(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape`` and ``dtype`` (contents undefined)."""
        numel = 1
        for s in shape:
            numel *= s
        nbytes = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
        size_class = 1 << (nbytes - 1).bit_length()
        with self._lock:
            bucket = self._free.get(size_class)
            raw = bucket.pop() if bucket else None
        if raw is None:
            from accelerators import get_accelerator

            raw = get_accelerator().empty_host((size_class,), torch.uint8, pinned=True)
        view = raw[: numel * raw.new_empty((), dtype=dtype).element_size()].view(dtype).view(shape)
        view._mpicomm_raw = raw  # type: ignore[attr-defined]
        return view

    def release(self, view: torch.Tensor) -> None:
        """Return a buffer from acquire() to the pool."""
        raw = view._mpicomm_raw  # type: ignore[attr-defined]
        with self._lock:
            self._free.setdefault(raw.numel(), []).append(raw)

    def clear(self) -> None:
        """Drop all cached buffers."""
        with self._lock:
            self._free.clear()


STAGING = StagingPool()
