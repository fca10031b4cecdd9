"""Byte sizes as the bench programs take and print them: ``8``, ``1K``, ``64M``, ``8:64M``."""
from __future__ import annotations

import re

__all__ = ["parse_size", "parse_sizes", "format_size"]

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
    from mpicomm import format_bytes  # here: importing mpicomm starts MPI, bench plot must not

    return format_bytes(n, compact=True)
