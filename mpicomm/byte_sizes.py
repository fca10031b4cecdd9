"""Byte counts for people and for size arguments ("1.5 MiB", "64M")."""
from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: float, compact: bool = False) -> str:
    """A byte count for people: "512 B", "1.5 MiB".

    ``compact``: exact binary multiples as size arguments take them ("8", "4K", "64M"), else the
    plain number.
    """
    units = (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10))
    if compact:
        for unit, scale in units:
            if n >= scale and n % scale == 0:
                return f"{int(n) // scale}{unit}"
        return str(int(n))
    for unit, scale in units:
        if n >= scale:
            return f"{n / scale:.1f} {unit}iB"
    return f"{int(n)} B"
