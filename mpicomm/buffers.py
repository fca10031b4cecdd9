"""Turn user buffers (torch, numpy, cupy) into MPI buffer specs, and put results back where they belong."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from mpi4py import MPI

from . import dtypes
from .device_paths import STAGING, DevicePolicy
from .errors import check_type, fail_value

IN, OUT, INOUT = 1, 2, 3
_fromaddress = MPI.buffer.fromaddress


def to_tensor(obj, call: str, arg: str, writable: bool) -> torch.Tensor:
    """A detached torch tensor sharing ``obj``'s memory (torch tensor, numpy array or cupy array)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, np.ndarray):
        if not obj.dtype.isnative:
            fail_value(call, arg, "a numpy array in native byte order", f"byte order {obj.dtype.byteorder!r}")
        if obj.dtype not in dtypes.NUMPY_TO_TORCH:
            names = ", ".join(str(d) for d in dtypes.NUMPY_TO_TORCH)
            check_type(call, arg, obj, f"a numpy array of dtype {names}", ok=False)
        if not obj.flags.writeable:
            if writable:
                fail_value(call, arg, "a writable numpy array (results are written into it)",
                           "a read-only array")
            obj = obj.copy()
        return torch.from_numpy(obj)
    if hasattr(obj, "__cuda_array_interface__") and type(obj).__module__.startswith("cupy"):
        return torch.from_dlpack(obj)  # zero-copy; orders cupy's stream before torch's current stream
    check_type(call, arg, obj, "a torch.Tensor, numpy.ndarray or cupy.ndarray", ok=False)
    raise AssertionError("unreachable")


def spec(t: torch.Tensor, mpi_type) -> list:
    """mpi4py buffer spec [buffer, datatype] over a contiguous tensor (host or device).

    The count is left to mpi4py, which derives it from the byte size (and divides it by the
    communicator size where the MPI call takes per-rank counts).
    """
    return [_fromaddress(t.data_ptr(), t.numel() * t.element_size()), mpi_type]


class Slot:
    """One user buffer prepared for an MPI call: ``spec`` for MPI, ``finish()`` to put results back."""

    __slots__ = ("user", "work", "mpi_type", "role", "staged", "copied", "scale")

    def __init__(self, user: torch.Tensor, work: torch.Tensor, mpi_type, role: int,
                 staged: bool, copied: bool) -> None:
        self.user = user
        self.work = work
        self.mpi_type = mpi_type
        self.role = role
        self.staged = staged
        self.copied = copied
        self.scale: float | None = None  # divide the result by this before it lands (AVG)

    @property
    def spec(self) -> list:
        return spec(self.work, self.mpi_type)

    @property
    def has_finish(self) -> bool:
        """Whether finish() has anything to do."""
        return self.staged or (self.role != IN and (self.copied or self.scale is not None))

    def finish(self) -> None:
        """After MPI completes: scale, copy back into the user's buffer, release staging memory."""
        if self.role != IN:
            if self.scale is not None:
                self.work.div_(self.scale)
            if self.copied:
                self.user.copy_(self.work.view(self.user.shape) if self.work.shape != self.user.shape
                                else self.work)
        if self.staged:
            STAGING.release(self.work)
            self.staged = False


def prepare(t: torch.Tensor, role: int, mpi_type, wire_dtype: torch.dtype,
            policy: Callable[[], DevicePolicy] | None, mpi_call: str) -> Slot:
    """Make ``t`` usable by MPI: contiguous, in ``wire_dtype``, on the host unless MPI takes device memory."""
    on_device = not t.is_cpu
    direct = not on_device or policy().direct(mpi_call)
    # a tensor with torch's negative or conjugate bit set is staged: MPI would move its raw bits
    if direct and t.dtype == wire_dtype and t.is_contiguous() and not (t.is_neg() or t.is_conj()):
        if on_device:
            _sync(t)
        return Slot(t, t, mpi_type, role, staged=False, copied=False)
    if direct:
        work = torch.empty(t.shape, dtype=wire_dtype, device=t.device)
        staged = False
    else:
        work = STAGING.acquire(tuple(t.shape), wire_dtype)
        staged = True
    if role != OUT:
        work.copy_(t)  # contiguous, upcast and device-to-host in one step
    if on_device and direct:
        _sync(t)
    return Slot(t, work, mpi_type, role, staged=staged, copied=True)


def _sync(t: torch.Tensor) -> None:
    from accelerators import get_accelerator

    get_accelerator().stream_synchronize(t.device)


def host_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory ranges overlap (addresses are unique across host and devices)."""
    a0 = a.data_ptr()
    b0 = b.data_ptr()
    return a0 < b0 + _extent(b) and b0 < a0 + _extent(a)


def _extent(t: torch.Tensor) -> int:
    if t.is_contiguous():
        return t.nbytes
    if t.numel() == 0:
        return 0
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()
