"""The exceptions ckpt raises for checkpoint problems: one base, ``CheckpointError``, with an exit code.

``exit_code`` is what ``python -m ckpt`` returns for the error (the codes below). Subclasses keep
the built-in exception they refine as a second base (``ValueError``, ``KeyError``,
``FileExistsError``...) so that code catching those keeps working.
"""
from __future__ import annotations

from dataclasses import dataclass

EXIT_OK = 0
EXIT_DAMAGED = 1      # checksum mismatch, truncated or missing data file
EXIT_USAGE = 2        # bad arguments, or no readable checkpoint at the path (missing, bad or newer manifest)
EXIT_INCOMPLETE = 3   # a save that never finished
EXIT_PICKLE = 4       # the source holds a pickled Python global outside DeepSpeed's allowlist
EXIT_EXISTS = 5       # the destination exists and --overwrite was not given
EXIT_FAILED = 6       # anything else: I/O or MPI errors, an unsupported source, another rank's failure


@dataclass(frozen=True)
class FailureReport:
    """A record (not an exception) of what failed on one rank: its number, the exception's type
    name and message; ``CheckpointError.failures`` lists them."""

    rank: int
    type_name: str
    message: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.type_name}: {self.message}"


class CheckpointError(Exception):
    """Base of every checkpoint problem ckpt raises; ``exit_code`` is the CLI's exit status.

    ``failures`` lists what failed on which rank when the error was raised by a collective
    step (empty for an error raised by one process on its own)."""

    exit_code: int = EXIT_FAILED
    failures: tuple[FailureReport, ...] = ()


class ChecksumError(CheckpointError, RuntimeError):
    """Bytes read from a checkpoint do not match the checksums in its manifest."""

    exit_code = EXIT_DAMAGED


class StepFailedError(CheckpointError, RuntimeError):
    """A step of a collective save or load failed on some rank with an error that is not a
    ``CheckpointError`` (raised on every rank, also as the original's built-in type);
    ``failures`` says where and how."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """The destination of a save, convert or export exists and overwriting was not asked for."""

    exit_code = EXIT_EXISTS


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no checkpoint (of the expected kind) at the path given."""

    exit_code = EXIT_USAGE


class StateMismatchError(CheckpointError, KeyError, ValueError):
    """The model's state names or shapes differ from the checkpoint's (``load(strict=True)``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class IncompatibleStateError(CheckpointError, ValueError, TypeError):
    """The objects given to ``save``/``load`` cannot give or take this checkpoint's state: another
    optimizer class, other param groups, another world size for a sharded optimizer, state of a
    kind that cannot be stored, a state item missing from the checkpoint."""
