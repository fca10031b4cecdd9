"""Memory read from /proc (Linux): this process's resident size (current, peak, resetting the
peak), the machine's available memory, and whether an estimated run fits in it (so that a
benchmark declines a case it cannot hold instead of being killed for memory)."""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["rss_kib", "reset_peak_rss", "malloc_returns_memory", "mem_available_kib", "MemoryFit", "linear_fit",
           "memory_fit", "gib"]


def rss_kib(field: str = "VmRSS") -> int:
    """One ``/proc/self/status`` field in KiB: ``VmRSS`` (resident now) or ``VmHWM`` (peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status; expected VmRSS or VmHWM on Linux")


def reset_peak_rss() -> str | None:
    """Reset ``VmHWM`` to the current resident size; None on success, else why it could not."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return None
    except OSError as exc:
        return f"cannot reset the peak resident size (/proc/self/clear_refs: {exc.strerror})"


def malloc_returns_memory() -> None:
    """Large blocks from mmap and returned on free (a fixed threshold turns off glibc's dynamic
    one), so that memory freed by one measurement is not counted as resident in the next."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 << 10)    # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 << 10)    # M_TRIM_THRESHOLD
    except OSError:  # pragma: no cover - not glibc
        pass


def mem_available_kib() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in KiB: what can be allocated without swapping."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    raise RuntimeError("no MemAvailable in /proc/meminfo; expected Linux 3.14 or later")


@dataclass(frozen=True)
class MemoryFit:
    """A run's estimated memory (``need_kib``, the safety margin applied) beside what is available,
    and the largest count of units that fits (0: not even one)."""

    need_kib: int
    available_kib: int
    largest_fitting: int

    @property
    def fits(self) -> bool:
        return self.need_kib <= self.available_kib


def linear_fit(x1: float, y1: float, x2: float, y2: float) -> tuple[float, float]:
    """The line through two measurements as (value at 0, growth per unit), the growth at least 0."""
    per = max(0.0, (y2 - y1) / (x2 - x1)) if x2 != x1 else 0.0
    return max(0.0, y1 - per * x1), per


def memory_fit(fixed_kib: float, per_unit_kib: float, units: int, safety: float = 1.5,
               available_kib: int | None = None) -> MemoryFit:
    """Whether ``fixed_kib + per_unit_kib * units``, times ``safety``, fits in ``available_kib``
    (default: MemAvailable now)."""
    if safety < 1 or per_unit_kib < 0 or fixed_kib < 0 or units < 0:
        raise ValueError(f"memory_fit: expected safety >= 1 and sizes >= 0, got safety={safety}, "
                         f"fixed_kib={fixed_kib}, per_unit_kib={per_unit_kib}, units={units}")
    avail = mem_available_kib() if available_kib is None else available_kib
    need = safety * (fixed_kib + per_unit_kib * units)
    room = avail / safety - fixed_kib
    if per_unit_kib:
        largest = max(0, int(room // per_unit_kib))
    else:
        largest = units if room >= 0 else 0
    return MemoryFit(int(math.ceil(need)), avail, largest)


def gib(kib: float) -> str:
    """A size in KiB written in GiB (MiB below one GiB)."""
    return f"{kib / (1 << 20):.1f} GiB" if kib >= 1 << 20 else f"{kib / 1024:.0f} MiB"
