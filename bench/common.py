"""Shared pieces of the bench programs: arguments, iteration schedule, headers, tables, timing, JSON.

Records live in ``bench.records``, plots in ``bench.plot`` (both re-exported here); memory
readings in ``bench.memory``, models in ``bench.models``, ``comma_list`` in ``bench.arguments``.

Every program prints and writes through one :class:`Reporter` (the same header, table layout
and JSON record envelope; bench/README.md "Output"). A measurement program's shape::

    parser = argparse.ArgumentParser(prog="python -m bench NAME")
    add_common_args(parser)
    args = parser.parse_args(argv)
    rep = Reporter("NAME", mpi_comm, args, columns=DEFAULT_COLUMNS)   # notes a missing matplotlib
    info = rep.start(dtype="float32")                                 # '#' header lines on rank 0
    for size in args.sizes:
        times, warmup, iters = timed(fn, size, mpi_comm, iters=args.iters, warmup=args.warmup,
                                     budget_s=args.budget)            # OSU schedule, (min, mean, max) s
        rep.emit(make_record(..., info=info, times_s=times))          # one table row + JSON record
    return rep.finish()                                               # plot; 1 if any value was wrong

Programs with several tables call ``rep.section(title, columns)`` before each; records of other
kinds start from ``rep.base(op)`` (the envelope: bench, op, ranks, hosts, network).

Only rank 0 prints and writes files; everything else here is collective where it says so.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, TextIO

from accelerators.mpi_lib import library_version
from mpicomm import format_bytes
from mpi4py import MPI

from .arguments import comma_list
from .env import clean_env, free_port, init_gloo
from .plot import PLOT_Y, matplotlib_missing, plot_curves, plot_records
from .records import RECORD_FIELDS, make_record, median_round, validate_record

__all__ = [
    "RECORD_FIELDS", "DEFAULT_COLUMNS", "Column", "Table", "JsonWriter", "Reporter",
    "parse_size", "parse_sizes", "format_size", "add_common_args", "iteration_schedule", "timed",
    "schedule_text", "PLOT_Y",
    "environment_info", "header_lines", "time_loop", "across_ranks", "busbw_factor",
    "bandwidths", "make_record", "median_round", "validate_record", "plot_records",
    "matplotlib_missing", "add_rounds_arg", "clean_env",
    "free_port", "init_gloo", "comma_list",
]

# ---------------------------------------------------------------------------------------------
# sizes

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse a byte count such as ``8``, ``1K``, ``64M``, ``64MiB`` or ``1G`` (binary units)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"expected a size like 8, 1K, 64M or 1G, got {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_sizes(spec: str) -> list[int]:
    """Parse ``--sizes``: ``LO:HI`` doubles from LO to HI, ``64M`` is one size, commas join lists."""
    sizes: list[int] = []
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        if ":" in part:
            lo_text, hi_text = part.split(":", 1)
            lo, hi = parse_size(lo_text), parse_size(hi_text)
            if lo <= 0 or hi < lo:
                raise ValueError(f"expected LO:HI with 0 < LO <= HI, got {part!r}")
            s = lo
            while s <= hi:
                sizes.append(s)
                s *= 2
        else:
            s = parse_size(part)
            if s <= 0:
                raise ValueError(f"expected a positive size, got {part!r}")
            sizes.append(s)
    if not sizes:
        raise ValueError(f"expected at least one size, got {spec!r}")
    return sizes


def format_size(n: int) -> str:
    """Format a byte count compactly: 8, 1K, 64M (exact binary units), else the plain number."""
    return format_bytes(n, compact=True)


# ---------------------------------------------------------------------------------------------
# arguments and iterations

def _sizes_arg(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0, got {value}")
    return value


def add_common_args(parser: argparse.ArgumentParser, *, default_sizes: str = "8:64M") -> None:
    """Add ``--sizes --iters --warmup --json --plot`` to a program's parser."""
    parser.add_argument("--sizes", type=_sizes_arg, default=parse_sizes(default_sizes),
                        metavar="SPEC",
                        help=f"message sizes in bytes: LO:HI doubles, 64M is one size, commas "
                             f"join lists (default {default_sizes})")
    parser.add_argument("--iters", type=_positive_int, default=None, metavar="N",
                        help="timed iterations per size (default: OSU-style, more for small sizes)")
    parser.add_argument("--warmup", type=_positive_int, default=None, metavar="N",
                        help="untimed warm-up iterations per size (default: OSU-style)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                        help="cap the OSU-style iteration count so that one measurement takes "
                             f"about this long (default {DEFAULT_BUDGET_S:g}; 0: no cap; "
                             "never below the schedule's minimum, never with --iters)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write one JSON record per measurement to FILE")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw time or bandwidth against size (needs matplotlib)")
    parser.add_argument("--plot-y", choices=sorted(PLOT_Y), default="busbw",
                        help="what --plot draws against size (default busbw)")


def add_rounds_arg(parser: argparse.ArgumentParser, default: int = 3) -> None:
    """Add ``--rounds R``: interleaved measurement rounds per size (the median is reported)."""
    def rounds(text: str) -> int:
        value = _positive_int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected at least 1 round, got {value}")
        return value

    parser.add_argument("--rounds", type=rounds, default=default, metavar="R",
                        help="measure each size in R rounds, interleaved across peers; the table "
                             f"and JSON report the median round with min/max (default {default})")


# OSU micro-benchmarks run 1000 iterations (200 warm-up) up to 8 KiB and 100 (10) above. The
# large-message count here falls with size instead, so that a 64 MiB sweep stays short on a
# laptop: about SMALL_ITERS * LARGE_THRESHOLD bytes per size, never fewer than MIN_ITERS.
SMALL_ITERS, SMALL_WARMUP = 1000, 100
LARGE_THRESHOLD = 8 << 10
MIN_ITERS, MIN_WARMUP = 10, 2
DEFAULT_BUDGET_S = 1.0


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


# ---------------------------------------------------------------------------------------------
# environment and header

def environment_info(mpi_comm: MPI.Comm) -> dict:
    """Collective: MPI vendor and versions, ranks, hosts; the same dict on every rank."""
    import mpi4py

    names = mpi_comm.allgather(MPI.Get_processor_name())
    hosts = sorted(set(names))
    vendor, vver = MPI.get_vendor()
    info = {
        "mpi_vendor": vendor,
        "mpi_version": ".".join(map(str, vver)),
        "mpi_library": library_version().splitlines()[0].strip(),
        "mpi4py_version": mpi4py.__version__,
        "ranks": mpi_comm.Get_size(),
        "hosts": len(hosts),
        "host_names": hosts,
        "network": os.environ.get("MPICOMM_BENCH_NETWORK", "local"),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import numpy
        info["numpy_version"] = numpy.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        import torch
        info["torch_version"] = torch.__version__
    except ImportError:  # pragma: no cover
        info["torch_version"] = None
    return mpi_comm.bcast(info, root=0)


def header_lines(bench: str, info: dict, *, dtype: str, iterations: str,
                 extra: Iterable[str] = ()) -> list[str]:
    """The ``#`` lines printed above a table."""
    hosts = ", ".join(info["host_names"][:8]) + (" ..." if len(info["host_names"]) > 8 else "")
    lines = [
        f"# mpicomm benchmark: {bench}",
        f"# MPI: {info['mpi_vendor']} {info['mpi_version']} ({info['mpi_library']})",
        f"# mpi4py {info['mpi4py_version']}, torch {info.get('torch_version')}, "
        f"numpy {info.get('numpy_version')}",
        f"# ranks: {info['ranks']}, hosts: {info['hosts']} ({hosts}), network: {info['network']}",
        f"# dtype: {dtype}",
        f"# iterations: {iterations}",
    ]
    lines += [f"# {line}" for line in extra]
    return lines


# ---------------------------------------------------------------------------------------------
# timing and bandwidth

def across_ranks(mpi_comm: MPI.Comm, value: float) -> tuple[float, float, float]:
    """Collective: ``(min, mean, max)`` of one float over all ranks."""
    values = mpi_comm.allgather(float(value))
    return min(values), sum(values) / len(values), max(values)


def time_loop(fn: Callable[[], object], iters: int, warmup: int, mpi_comm: MPI.Comm,
              sync: Callable[[], None] | None = None) -> tuple[float, float, float]:
    """Collective: run ``fn`` warmup + iters times; seconds per iteration as (min, mean, max) over ranks.

    Each rank times its own loop after a barrier (as the OSU benchmarks do); ``sync`` (for device
    work) runs before each clock read.
    """
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    mpi_comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if sync is not None:
        sync()
    elapsed = (time.perf_counter() - t0) / max(1, iters)
    return across_ranks(mpi_comm, elapsed)


def timed(fn: Callable[[], object], size_bytes: int, mpi_comm: MPI.Comm, *,
          iters: int | None = None, warmup: int | None = None,
          budget_s: float | None = DEFAULT_BUDGET_S,
          sync: Callable[[], None] | None = None) -> tuple[tuple[float, float, float], int, int]:
    """Collective: time ``fn`` on the OSU schedule; ``((min, mean, max) seconds, warmup, iters)``.

    Without ``iters``, the count is capped so the timed loop takes about ``budget_s`` (judged from
    the slowest rank's warm-up), but never below the schedule's minimum.
    """
    w, it = iteration_schedule(size_bytes, iters, warmup)
    t0 = time.perf_counter()
    for _ in range(w):
        fn()
    if sync is not None:
        sync()
    per_call = (time.perf_counter() - t0) / max(1, w)
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


# ---------------------------------------------------------------------------------------------
# JSON

class JsonWriter:
    """Rank-0 writer of ``{"meta": {...}, "records": [...]}``, rewritten atomically after each record."""

    def __init__(self, path: str | None, meta: dict, enabled: bool = True) -> None:
        self.path = path if enabled else None
        self.meta = meta
        self.records: list[dict] = []
        if self.path:
            self._write()

    def add(self, rec: dict) -> None:
        self.records.append(rec)
        if self.path:
            self._write()

    def _write(self) -> None:
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"meta": self.meta, "records": self.records}, f, indent=1)
            f.write("\n")
        os.replace(tmp, self.path)


# ---------------------------------------------------------------------------------------------
# table

@dataclass(frozen=True)
class Column:
    """One table column: record field, heading, width, format and alignment (``>`` or ``<``)."""

    field: str
    heading: str
    width: int
    fmt: str = ""
    align: str = ">"


DEFAULT_COLUMNS = (
    Column("op", "op", 15),
    Column("peer", "peer", 8),
    Column("size_bytes", "size(B)", 10, "d"),
    Column("count", "count", 9, "d"),
    Column("dtype", "type", 8),
    Column("time_us_min", "min(us)", 11, ".1f"),
    Column("time_us_mean", "avg(us)", 11, ".1f"),
    Column("time_us_max", "max(us)", 11, ".1f"),
    Column("algbw_gbps", "algbw(GB/s)", 12, ".3f"),
    Column("busbw_gbps", "busbw(GB/s)", 12, ".3f"),
    Column("wrong", "#wrong", 7, "d"),
)


class Table:
    """Streaming fixed-width table: heading once, then one flushed row per record.

    A first column aligned left (``align="<"``, for names) indents every row by two spaces, so
    that the heading's ``#`` stands in front of it."""

    def __init__(self, columns: Sequence[Column], out: TextIO | None = None,
                 enabled: bool = True) -> None:
        self.columns = tuple(columns)
        self.out = out
        self.enabled = enabled
        self._headed = False
        self._lead = "  " if self.columns and self.columns[0].align == "<" else ""

    def _print(self, line: str) -> None:
        out = self.out if self.out is not None else sys.stdout
        print(line, file=out, flush=True)

    def heading(self) -> str:
        cells = [f"{c.heading:{c.align}{c.width}}" for c in self.columns]
        if not cells:
            return "#"
        line = " ".join(cells).rstrip()
        return "# " + line if self._lead else "#" + line[1:]

    def format_row(self, rec: dict) -> str:
        cells = []
        for c in self.columns:
            value = rec.get(c.field, "")
            if value is None or value == "":
                text = "-"
            elif c.fmt and isinstance(value, (int, float)) and not isinstance(value, bool):
                text = format(value, c.fmt)
            else:
                text = str(value)
            cells.append(f"{text:{c.align}{c.width}}")
        return (self._lead + " ".join(cells)).rstrip()

    def row(self, rec: dict) -> None:
        if not self.enabled:
            return
        if not self._headed:
            self._print(self.heading())
            self._headed = True
        self._print(self.format_row(rec))

    def note(self, line: str) -> None:
        if self.enabled:
            self._print(line if line.startswith("#") else f"# {line}")


# ---------------------------------------------------------------------------------------------
# the reporter: header, table, JSON and plot together

class Reporter:
    """Rank-0 output of every bench program: '#' header, streaming tables, JSON records, plot.

    ``start`` prints the header and opens ``--json``; ``emit`` prints one row and appends one
    record; ``section`` starts a new table (its own columns) under a ``# == title`` line;
    ``show`` prints a row that is not a record; ``finish`` draws ``--plot`` and prints the verdict.
    """

    def __init__(self, bench: str, mpi_comm: MPI.Comm, args: argparse.Namespace,
                 columns: Sequence[Column] = DEFAULT_COLUMNS, *, plot_y: str = "busbw_gbps",
                 out: TextIO | None = None) -> None:
        self.bench = bench
        self.mpi_comm = mpi_comm
        self.args = args
        self.root = mpi_comm.Get_rank() == 0
        self.out = out
        self.table = Table(columns, out=out, enabled=self.root)
        self.plot_path = getattr(args, "plot", None)
        self.plot_y = PLOT_Y.get(getattr(args, "plot_y", None) or "", plot_y)
        self.info: dict = {}
        self.json: JsonWriter | None = None
        self.records: list[dict] = []
        self.wrong = 0
        # a missing matplotlib skips the plot with one note on rank 0; the measurements still run
        self.plot_problem = matplotlib_missing() if self.plot_path else None

    def start(self, *, dtype: str, extra: Iterable[str] = (), iterations: str | None = None,
              meta: dict | None = None) -> dict:
        """Collective: gather the environment, print the header on rank 0, open the JSON file.

        ``iterations`` describes the schedule (default: the OSU schedule of ``--iters``/
        ``--warmup``/``--budget``); ``meta`` adds program fields to the JSON file's meta."""
        self.info = environment_info(self.mpi_comm)
        if iterations is None:
            iterations = schedule_text(getattr(self.args, "iters", None),
                                       getattr(self.args, "warmup", None),
                                       getattr(self.args, "budget", None))
        if self.root:
            for line in header_lines(self.bench, self.info, dtype=dtype, iterations=iterations,
                                     extra=extra):
                self.table._print(line)
            if self.plot_problem:
                self.note(f"--plot {self.plot_path} skipped: {self.plot_problem}")
        meta = dict(self.info, bench=self.bench, dtype=dtype, iterations=iterations,
                    argv=sys.argv[1:], **(meta or {}))
        problem = None
        try:
            self.json = JsonWriter(getattr(self.args, "json", None), meta, enabled=self.root)
        except OSError as exc:
            problem = f"cannot write --json {self.args.json}: {exc.strerror}"
        problem = self.mpi_comm.bcast(problem, root=0)
        if problem:  # every rank stops, none waits for the others
            if self.root:
                print(f"bench {self.bench}: {problem}", file=sys.stderr)
            raise SystemExit(2)
        return self.info

    def base(self, op: str) -> dict:
        """The fields every record starts with: bench, op, ranks, hosts, network (after ``start``)."""
        return {"bench": self.bench, "op": op, "ranks": int(self.info["ranks"]),
                "hosts": int(self.info["hosts"]), "network": self.info.get("network")}

    def emit(self, rec: dict, *, show: bool = True) -> None:
        """Record one measurement (call on every rank with the same record); ``show=False``: in
        the JSON file only (the table shows it another way, through ``show``)."""
        self.records.append(rec)
        self.wrong += int(rec.get("wrong", 0))
        if show:
            self.table.row(rec)
        if self.json is not None:
            self.json.add(rec)

    def show(self, row: dict) -> None:
        """Print one table row that is not a record (a view of records already emitted)."""
        self.table.row(row)

    def section(self, title: str, columns: Sequence[Column]) -> None:
        """Start a new table with its own columns under a ``# == title`` line."""
        if self.root:
            self.table._print("#")
            self.note(f"== {title}")
        self.table = Table(columns, out=self.out, enabled=self.root)

    def note(self, line: str) -> None:
        self.table.note(line)

    def finish(self, ok: str = "all values correct (#wrong = 0)", *,
               title: str | None = None) -> int:
        """Draw the plot, print the verdict on wrong values; 1 if any value was wrong, else 0."""
        if self.root and self.plot_path and self.records and not self.plot_problem:
            title = title or (f"mpicomm bench {self.bench}: ranks {self.info.get('ranks')}, "
                              f"hosts {self.info.get('hosts')}, {self.info.get('network')}")
            if any(r.get("op") == "curve" for r in self.records):
                plot_curves(self.records, self.plot_path, title=title)
            else:
                plot_records(self.records, self.plot_path, y=self.plot_y, title=title)
            self.note(f"plot written to {self.plot_path}")
        if self.root and getattr(self.args, "json", None):
            self.note(f"{len(self.records)} JSON records written to {self.args.json}")
        if self.wrong:
            self.note(f"FAILED: {self.wrong} wrong values")
            return 1
        self.note(ok)
        return 0
