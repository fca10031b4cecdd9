"""Observability: torch.profiler events and DEBUG logs for every collective, an INFO line at init.

``logging.getLogger("mpicomm")`` is the package's logger; ``MPICOMM_LOG_LEVEL`` (e.g. ``DEBUG``)
sets its level and, when the application has configured no handler for it, adds one writing to
stderr. Every Communicator collective shows up in ``torch.profiler`` traces as a user annotation
named ``mpicomm:<op>`` (with ``record_shapes=True`` its args carry ``bytes`` and ``dtype``); at
DEBUG each call is logged with op, dtype, bytes and duration. When neither a profiler nor DEBUG
logging is active a call costs two flag checks.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Any, Callable

import torch
import torch.autograd.profiler as _profiler
from mpi4py import MPI

from . import dtypes
from .byte_sizes import format_bytes

log = logging.getLogger("mpicomm")
LEVEL_VAR = "MPICOMM_LOG_LEVEL"

try:  # records keyword values (bytes, dtype) into the trace's args
    from torch._C._profiler import _RecordFunctionFast as _Record
except ImportError:  # pragma: no cover - older torch: the name alone
    _Record = None


def configure_from_env() -> None:
    """Apply MPICOMM_LOG_LEVEL to the "mpicomm" logger (a stderr handler if it has none)."""
    text = os.environ.get(LEVEL_VAR, "").strip()
    if not text:
        return
    level = logging.getLevelName(text.upper()) if not text.isdigit() else int(text)
    if not isinstance(level, int):
        raise ValueError(f"{LEVEL_VAR}={text!r}: expected DEBUG, INFO, WARNING, ERROR or a number")
    log.setLevel(level)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        log.addHandler(handler)


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(x) for x in obj)
    return int(getattr(obj, "nbytes", 0) or 0) if hasattr(obj, "dtype") else 0


def _first_dtype(values) -> str:
    for obj in values:
        if isinstance(obj, (list, tuple)) and obj:
            obj = obj[0]
        dtype = getattr(obj, "dtype", None)
        if dtype is not None:
            return dtypes.name(dtype)
    return "-"


_DEBUG = logging.DEBUG
# Logger.isEnabledFor's own per-level cache (cleared in place whenever levels change): one dict
# lookup instead of a method call on every collective; a missing entry asks the logger (which
# fills the cache). Bound once: looking ``get`` up on every call cost ~30 ns more.
_debug_cached = getattr(log, "_cache", {}).get


def observing() -> bool:
    """Whether a profiler or DEBUG logging wants to see calls (fast paths then step aside)."""
    return _profiler._is_profiler_enabled or (_debug_cached(_DEBUG) is not False
                                              and log.isEnabledFor(_DEBUG))


_quiet = threading.local()  # depth > 0: a caller records one event for the calls it makes


class quiet:
    """While entered, this thread's Communicator calls record no profiler events of their own
    (the process group records one per call instead); DEBUG logs go on."""

    def __enter__(self) -> None:
        _quiet.depth = getattr(_quiet, "depth", 0) + 1

    def __exit__(self, *exc) -> None:
        _quiet.depth -= 1


def _tensors(values) -> list:
    out = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out.extend(_tensors(v))
        elif isinstance(v, torch.Tensor):
            out.append(v)
    return out


class Event:
    """A profiler event begun on this thread, ended by :meth:`end` on any thread (a torch
    future's end callbacks carry the profiler's thread state there: an async event)."""

    __slots__ = ("_done",)

    def __init__(self, label: str, tensors: list) -> None:
        handle = torch._C._autograd._record_function_with_args_enter(label, *tensors)
        self._done = torch.futures.Future()
        torch.ops.profiler._call_end_callbacks_on_jit_fut(handle, self._done)

    def end(self) -> None:
        self._done.set_result(None)


def begin_event(label: str, values) -> Event | None:
    """A started profiler event ``label`` recording the shapes of the tensors in ``values``
    (lists of lists too), or None when no profiler runs."""
    if not _profiler._is_profiler_enabled:
        return None
    return Event(label, _tensors(values))


def observed_as(op: str) -> Callable[[Callable], Callable]:
    """:func:`observed`, naming the call ``op`` (for a general path behind a fast path)."""
    return lambda method: observed(method, op)


def observed(method: Callable, op: str | None = None) -> Callable:
    """Wrap a Communicator method so that profilers and DEBUG logs see each call (and its MPI
    errors pass through ``Communicator._surface``: a rank failure raises RankFailedError)."""
    op = op or method.__name__
    label = f"mpicomm:{op}"

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            if _profiler._is_profiler_enabled or (_debug_cached(_DEBUG) is not False
                                                  and log.isEnabledFor(_DEBUG)):
                return _traced(method, op, label, self, args, kwargs)
            return method(self, *args, **kwargs)
        except MPI.Exception as exc:  # a rank failure becomes RankFailedError (Communicator._surface)
            self._raise_surfaced(exc, op)

    return call


def _traced(method: Callable, op: str, label: str, comm, args: tuple, kwargs: dict) -> Any:
    values = list(args) + list(kwargs.values())
    nbytes = sum(_nbytes(v) for v in values)
    dtype = _first_dtype(values)
    start = time.perf_counter()
    if _profiler._is_profiler_enabled and not getattr(_quiet, "depth", 0):
        if _Record is not None:
            record = _Record(label, [], {"bytes": nbytes, "dtype": dtype})
        else:  # pragma: no cover
            record = torch.profiler.record_function(label, f"bytes={nbytes}, dtype={dtype}")
        with record:
            result = method(comm, *args, **kwargs)
    else:
        result = method(comm, *args, **kwargs)
    if log.isEnabledFor(logging.DEBUG):
        took = (time.perf_counter() - start) * 1e6
        started = " (started; async)" if (op[0] == "i" or kwargs.get("async_op")
                                          or (args and args[-1] is True)) else ""
        size = f"{nbytes} B" if nbytes < 1024 else f"{format_bytes(nbytes)} ({nbytes} B)"
        log.debug("rank %d: %s %s %s in %.1f us%s", comm.rank, op, dtype, size, took, started)
    return result


def log_init(comm) -> None:
    """INFO: MPI library, large-count support, rank, local rank, accelerator device, CUDA-aware verdict."""
    if not log.isEnabledFor(logging.INFO):
        return
    from mpi4py import MPI

    from accelerators import get_accelerator
    from accelerators.mpi_lib import library_line

    from . import large

    acc = get_accelerator()
    try:
        device = acc.device_name(acc.local_device_index())
    except Exception as exc:  # noqa: BLE001 - the log says what it can
        device = f"unknown ({type(exc).__name__}: {exc})"
    verdict = acc.cuda_aware_verdict()
    counts = "native" if large.MAX_COUNT > 2 ** 31 - 1 else "split above 2^31-1"
    log.info("rank %d of %d, local rank %d of %d; MPI: %s (standard %s; large counts %s); "
             "accelerator %s, device %s; CUDA-aware MPI: %s (%s: %s)", comm.rank, comm.size,
             comm.local_rank, comm.local_size, library_line(),
             ".".join(map(str, MPI.Get_version())), counts, acc.name, device, verdict.label,
             verdict.source, verdict.reason)


configure_from_env()
