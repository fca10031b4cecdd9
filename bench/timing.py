"""Timing of the bench programs: the OSU iteration schedule, timed loops over ranks, bandwidths.

``timed`` is what a measurement program calls per size and round: the schedule's warm-up, a
count capped to ``--budget``, a barrier, then each rank's own loop; ``(min, mean, max)`` seconds
per call over ranks. ``bandwidths`` turns a time into nccl-tests' algbw and busbw.
"""
from __future__ import annotations

import time
from typing import Callable

from mpi4py import MPI

from .arguments import DEFAULT_BUDGET_S
from .sizes import format_size

__all__ = ["SMALL_ITERS", "SMALL_WARMUP", "LARGE_THRESHOLD", "MIN_ITERS", "MIN_WARMUP",
           "DEFAULT_BUDGET_S", "iteration_schedule", "schedule_text", "across_ranks",
           "time_loop", "timed", "busbw_factor", "bandwidths"]

# OSU micro-benchmarks run 1000 iterations (200 warm-up) up to 8 KiB and 100 (10) above. The
# large-message count here falls with size instead, so that a 64 MiB sweep stays short on a
# laptop: about SMALL_ITERS * LARGE_THRESHOLD bytes per size, never fewer than MIN_ITERS.
SMALL_ITERS, SMALL_WARMUP = 1000, 100
LARGE_THRESHOLD = 8 << 10
MIN_ITERS, MIN_WARMUP = 10, 2


def iteration_schedule(size_bytes: int, iters: int | None = None,
                       warmup: int | None = None) -> tuple[int, int]:
    """Return ``(warmup, iters)`` for one size: the OSU manner, or the fixed counts given."""
    if size_bytes <= LARGE_THRESHOLD:
        auto_iters, auto_warmup = SMALL_ITERS, SMALL_WARMUP
    else:
        auto_iters = max(MIN_ITERS, SMALL_ITERS * LARGE_THRESHOLD // size_bytes)
        auto_warmup = max(MIN_WARMUP, auto_iters // 10)
    return (auto_warmup if warmup is None else warmup,
            max(1, auto_iters if iters is None else iters))


def schedule_text(iters: int | None, warmup: int | None, budget_s: float | None = None) -> str:
    """Describe the iteration schedule for the header."""
    if iters is None and warmup is None:
        cap = f"; capped at about {budget_s:g} s per measurement" if budget_s else ""
        return (f"OSU-style: {SMALL_ITERS} (+{SMALL_WARMUP} warm-up) up to "
                f"{format_size(LARGE_THRESHOLD)}, then falling with size to at least "
                f"{MIN_ITERS} (+{MIN_WARMUP}){cap}")
    w, i = iteration_schedule(1, iters, warmup)
    return f"{i} timed + {w} warm-up per size" + (
        "" if iters is not None and warmup is not None else " (the other count OSU-style)")


def across_ranks(mpi_comm: MPI.Comm, value: float) -> tuple[float, float, float]:
    """Collective: ``(min, mean, max)`` of one float over all ranks."""
    values = mpi_comm.allgather(float(value))
    return min(values), sum(values) / len(values), max(values)


def _run(fn: Callable[[], object], n: int, sync: Callable[[], None] | None) -> float:
    """Seconds to call ``fn`` ``n`` times, ``sync`` (device work) before the clock stops."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if sync is not None:
        sync()
    return time.perf_counter() - t0


def time_loop(fn: Callable[[], object], iters: int, warmup: int, mpi_comm: MPI.Comm,
              sync: Callable[[], None] | None = None) -> tuple[float, float, float]:
    """Collective: run ``fn`` warmup + iters times; seconds per iteration as (min, mean, max) over ranks.

    Each rank times its own loop after a barrier (as the OSU benchmarks do); ``sync`` (for device
    work) runs before each clock read.
    """
    _run(fn, warmup, sync)
    mpi_comm.Barrier()
    return across_ranks(mpi_comm, _run(fn, iters, sync) / max(1, iters))


def timed(fn: Callable[[], object], size_bytes: int, mpi_comm: MPI.Comm, *,
          iters: int | None = None, warmup: int | None = None,
          budget_s: float | None = DEFAULT_BUDGET_S,
          sync: Callable[[], None] | None = None) -> tuple[tuple[float, float, float], int, int]:
    """Collective: time ``fn`` on the OSU schedule; ``((min, mean, max) seconds, warmup, iters)``.

    Without ``iters``, the count is capped so the timed loop takes about ``budget_s`` (judged from
    the slowest rank's warm-up), but never below the schedule's minimum.
    """
    w, it = iteration_schedule(size_bytes, iters, warmup)
    per_call = _run(fn, w, sync) / max(1, w)
    if iters is None and budget_s and w > 0:
        slowest = mpi_comm.allreduce(per_call, op=MPI.MAX)
        if slowest > 0:
            it = max(min(it, MIN_ITERS), min(it, int(budget_s / slowest)))
    return time_loop(fn, it, 0, mpi_comm, sync), w, it


_BUSBW = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor: busbw = algbw * factor for ``n`` ranks."""
    if n < 1:
        raise ValueError(f"expected n >= 1 ranks, got {n}")
    base = op.split(":")[0]
    for key in (base, base.replace("allreduce", "all_reduce")):
        if key in _BUSBW:
            return _BUSBW[key](n)
    raise ValueError(f"no bus bandwidth factor for op {op!r}; expected one of {sorted(_BUSBW)}")


def bandwidths(size_bytes: int, seconds: float, op: str, n: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s (1e9 bytes/s), nccl-tests' definitions; size is the full buffer."""
    algbw = size_bytes / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * busbw_factor(op, n)
