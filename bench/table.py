"""The bench programs' fixed-width tables: columns, the measurement columns, a streaming table."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Sequence, TextIO

__all__ = ["Column", "MEASUREMENT_COLUMNS", "columns", "DEFAULT_COLUMNS", "Table"]


@dataclass(frozen=True)
class Column:
    """One table column: record field, heading, width, format and alignment (``>`` or ``<``)."""

    field: str
    heading: str
    width: int
    fmt: str = ""
    align: str = ">"


#: The columns of measurement records, by field: what ``columns`` takes by name.
MEASUREMENT_COLUMNS = {c.field: c for c in (
    Column("op", "op", 15),
    Column("peer", "peer", 8),
    Column("size_bytes", "size(B)", 10, "d"),
    Column("count", "count", 9, "d"),
    Column("dtype", "type", 8),
    Column("device", "dev", 4),
    Column("time_us_min", "min(us)", 11, ".1f"),
    Column("time_us_mean", "avg(us)", 11, ".1f"),
    Column("time_us_max", "max(us)", 11, ".1f"),
    Column("time_us_round_min", "min(us)", 11, ".1f"),
    Column("time_us_round_max", "max(us)", 11, ".1f"),
    Column("algbw_gbps", "algbw(GB/s)", 12, ".3f"),
    Column("busbw_gbps", "busbw(GB/s)", 12, ".3f"),
    Column("wire_bytes", "wire(B)", 11, "d"),
    Column("wrong", "#wrong", 7, "d"),
)}


def columns(*items: str | Column) -> tuple[Column, ...]:
    """A table's columns: a field name takes its column from ``MEASUREMENT_COLUMNS``, a
    ``Column`` stands for itself."""
    return tuple(MEASUREMENT_COLUMNS[c] if isinstance(c, str) else c for c in items)


DEFAULT_COLUMNS = columns("op", "peer", "size_bytes", "count", "dtype", "time_us_min",
                          "time_us_mean", "time_us_max", "algbw_gbps", "busbw_gbps", "wrong")


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

    def print(self, line: str) -> None:
        """Print one line as it is (flushed), whether or not the table is enabled."""
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
            self.print(self.heading())
            self._headed = True
        self.print(self.format_row(rec))

    def note(self, line: str) -> None:
        if self.enabled:
            self.print(line if line.startswith("#") else f"# {line}")
