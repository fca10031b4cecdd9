"""``python -m mpicomm.build_native [--cache DIR]``: compile the fast path's remembered-call check
(:mod:`mpicomm.native`) for the installed torch, load it and say where it is."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import native

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Build (if needed) and load the module; 1 with the reason when either fails."""
    parser = argparse.ArgumentParser(prog="python -m mpicomm.build_native",
                                     description="Compile and load mpicomm's native "
                                     "remembered-call check.")
    parser.add_argument("--cache", type=Path, default=None, help=f"default: {native.cache_dir()}")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        path = native.build(args.cache)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    if native.load(args.cache) is None:
        print(f"mpicomm.build_native: built {path} but it does not load", file=sys.stderr)
        return 1
    print(f"mpicomm.build_native: {path} ({time.perf_counter() - started:.1f} s); the fast "
          "path's remembered-call check now runs in C")
    return 0


if __name__ == "__main__":
    sys.exit(main())
