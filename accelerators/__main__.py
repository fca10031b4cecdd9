"""``python -m accelerators [--json]``: print each rank's diagnosis (gathered on rank 0)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    """Collect the diagnosis on every rank and print it from rank 0, in rank order."""
    parser = argparse.ArgumentParser(prog="python -m accelerators",
                                     description="Diagnose the accelerator and MPI set-up.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)

    from mpi4py import MPI

    from .diagnose import collect, format_report

    try:
        mine = collect()
    except Exception as exc:  # noqa: BLE001 - report the failure instead of hanging the gather
        mine = {"rank": MPI.COMM_WORLD.Get_rank(), "error": f"{type(exc).__name__}: {exc}"}
    reports = MPI.COMM_WORLD.gather(mine, root=0)
    if reports is None:
        return 0
    if args.json:
        print(json.dumps(reports, indent=2))
    else:
        for d in reports:
            if "error" in d:
                print(f"rank {d['rank']}: diagnosis failed: {d['error']}")
            else:
                print(format_report(d))
    return 1 if any("error" in d for d in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
