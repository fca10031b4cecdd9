"""A one-line text progress bar on stderr, for the command line's long jobs."""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

# What library calls accept as ``progress``: called with (phase, done, total).
ProgressFn = Callable[[str, int, int], None]


class Bar:
    """``Bar(enabled)(phase, done, total)`` redraws ``phase [#####.....]  50% 5/10`` in place
    (at most ten times a second, and always at the end of a phase); a new phase starts a new
    line. Disabled, it does nothing."""

    def __init__(self, enabled: bool, stream: TextIO | None = None, width: int = 30, prefix: str = "") -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.prefix = prefix
        self._phase: str | None = None
        self._last = 0.0
        self._open = False

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if phase != self._phase:
            self.close()
            self._phase = phase
        elif done < total and now - self._last < 0.1:
            return
        self._last = now
        frac = done / total if total > 0 else 1.0
        filled = int(round(frac * self.width))
        line = (f"\r{self.prefix}{phase} [{'#' * filled}{'.' * (self.width - filled)}] "
                f"{100 * frac:3.0f}% {done}/{total}")
        self.stream.write(line)
        self.stream.flush()
        self._open = True

    def close(self) -> None:
        """End the current line."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def report(progress: ProgressFn | None, phase: str, done: int, total: int) -> None:
    """Call ``progress`` if there is one."""
    if progress is not None:
        progress(phase, done, total)
