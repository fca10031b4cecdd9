"""Argument types shared by the bench programs (no MPI, no torch: bench.plot uses them too)."""
from __future__ import annotations

import argparse
from typing import Callable, Sequence

__all__ = ["comma_list"]


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
