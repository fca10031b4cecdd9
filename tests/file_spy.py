"""Record the MPI.File.Open calls that ckpt and elastic make (mpi4py's types are immutable, so
their modules' ``MPI`` is replaced by a view of mpi4py.MPI whose File.Open records the call)."""
from __future__ import annotations

import sys
from typing import Any, Callable

from mpi4py import MPI


class _File:
    def __init__(self, calls: list[str]) -> None:
        self._calls = calls

    def Open(self, comm, filename, *args, **kwargs):  # noqa: N802 - mpi4py's name
        self._calls.append(str(filename))
        return MPI.File.Open(comm, filename, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(MPI.File, name)


class _MPI:
    def __init__(self, calls: list[str]) -> None:
        self.File = _File(calls)

    def __getattr__(self, name: str) -> Any:
        return getattr(MPI, name)


def spy_file_opens(setattr_: Callable[[Any, str, Any], None] = setattr) -> list[str]:
    """Make every loaded ckpt and elastic module see the recording ``MPI``; returns the list that
    the opened file names are appended to. ``setattr_``: pytest's monkeypatch.setattr to undo it."""
    calls: list[str] = []
    view = _MPI(calls)
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] in ("ckpt", "elastic") and getattr(mod, "MPI", None) is MPI:
            setattr_(mod, "MPI", view)
    return calls
