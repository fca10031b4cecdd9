"""The one output path of every bench program: the :class:`Reporter` (header, tables, JSON, plot).

A measurement program's shape::

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
kinds start from ``rep.base(op)`` (the envelope: bench, op, ranks, hosts, network). A program
that tells its own story (``bench demo``) is ``narrative``: it prints its lines with
``rep.line`` instead of the header, tables and verdict, and writes the same JSON file.

Only rank 0 prints and writes files; ``start`` is collective, the rest is not.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterable, Sequence, TextIO

from mpi4py import MPI

from .arguments import PLOT_Y
from .env import environment_info
from .plot import matplotlib_missing, plot_crossover, plot_curves, plot_records
from .table import DEFAULT_COLUMNS, Column, Table
from .timing import schedule_text

__all__ = ["header_lines", "JsonWriter", "Reporter"]


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


class Reporter:
    """Rank-0 output of every bench program: '#' header, streaming tables, JSON records, plot.

    ``start`` prints the header and opens ``--json``; ``emit`` prints one row and appends one
    record; ``section`` starts a new table (its own columns) under a ``# == title`` line;
    ``show`` prints a row that is not a record; ``line`` prints a line as it is; ``finish``
    draws ``--plot`` and prints the verdict. ``narrative``: no header, tables or verdict, only
    the program's own ``line`` s (and the same JSON file).
    """

    def __init__(self, bench: str, mpi_comm: MPI.Comm, args: argparse.Namespace,
                 columns: Sequence[Column] = DEFAULT_COLUMNS, *, plot_y: str = "busbw_gbps",
                 out: TextIO | None = None, narrative: bool = False) -> None:
        self.bench = bench
        self.mpi_comm = mpi_comm
        self.args = args
        self.root = mpi_comm.Get_rank() == 0
        self.out = out
        self.narrative = narrative
        self.table = self._table(columns)
        self.plot_path = getattr(args, "plot", None)
        self.plot_y = PLOT_Y.get(getattr(args, "plot_y", None) or "", plot_y)
        self.info: dict = {}
        self.json: JsonWriter | None = None
        self.records: list[dict] = []
        self.wrong = 0
        # a missing matplotlib skips the plot with one note on rank 0; the measurements still run
        self.plot_problem = matplotlib_missing() if self.plot_path else None

    def _table(self, columns: Sequence[Column]) -> Table:
        return Table(columns, out=self.out, enabled=self.root and not self.narrative)

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
        if self.root and not self.narrative:
            for line in header_lines(self.bench, self.info, dtype=dtype, iterations=iterations,
                                     extra=extra):
                self.line(line)
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
        if self.root and not self.narrative:
            self.line("#")
            self.note(f"== {title}")
        self.table = self._table(columns)

    def line(self, text: str = "") -> None:
        """Print one line as it is, on rank 0."""
        if self.root:
            self.table.print(text)

    def note(self, line: str) -> None:
        self.table.note(line)

    def finish(self, ok: str = "all values correct (#wrong = 0)", *,
               title: str | None = None) -> int:
        """Draw the plot, print the verdict on wrong values; 1 if any value was wrong, else 0."""
        if self.root and self.plot_path and self.records and not self.plot_problem:
            title = title or (f"mpicomm bench {self.bench}: ranks {self.info.get('ranks')}, "
                              f"hosts {self.info.get('hosts')}, {self.info.get('network')}")
            ops = {r.get("op") for r in self.records}
            if "crossover" in ops:
                plot_crossover(self.records, self.plot_path, title=title)
            elif "curve" in ops:
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
