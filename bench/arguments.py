"""Arguments shared by the bench programs (no MPI, no torch: bench.plot uses them too).

``add_common_args`` gives a measurement program ``--sizes --iters --warmup --budget --json
--plot --plot-y``; ``add_rounds_arg`` its ``--rounds``; ``comma_list`` every comma-separated option.
"""
from __future__ import annotations

import argparse
from typing import Callable, Sequence

from .sizes import parse_sizes

__all__ = ["PLOT_Y", "DEFAULT_BUDGET_S", "comma_list", "add_common_args", "add_rounds_arg"]

# --y / --plot-y name -> record field
PLOT_Y = {"busbw": "busbw_gbps", "algbw": "algbw_gbps", "time": "time_us_mean"}
#: --budget: seconds one measurement should take about, when the iteration count is OSU-style
DEFAULT_BUDGET_S = 1.0


def comma_list(choices: Sequence[str] | None = None, *, all_word: bool = True
               ) -> Callable[[str], list[str]]:
    """An argparse type for ``a,b,c``: the non-empty items, each one of ``choices`` when given
    (``all`` alone: every choice, when ``all_word``)."""
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in str(text).split(",") if x.strip()]
        if choices is not None and all_word and items == ["all"]:
            return list(choices)
        bad = [x for x in items if choices is not None and x not in choices]
        if bad or not items:
            expected = (f"a comma list from {', '.join(choices)}" + (" (or 'all')" if all_word else "")
                        if choices is not None else "a non-empty comma list")
            raise argparse.ArgumentTypeError(
                f"expected {expected}, got {text!r}" + (f" (unknown: {', '.join(bad)})" if bad else ""))
        return items
    return parse


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
    """Add ``--sizes --iters --warmup --budget --json --plot --plot-y`` to a program's parser."""
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
