"""Resident memory of this process, read from /proc (Linux): current, peak, and resetting the peak."""
from __future__ import annotations

__all__ = ["rss_kib", "reset_peak_rss", "malloc_returns_memory"]


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
