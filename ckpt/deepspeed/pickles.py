"""Load pickles from other programs without running code: torch's weights-only unpickler with
an allowlist of named classes. DeepSpeed's torch.save files (the few DeepSpeed classes its
checkpoints hold, as inert stand-ins) after checking every zip entry's CRC-32; plain pickles
such as torch DCP's ``.metadata`` (``unpickle``, with the caller's allowlist). A global outside
the allowlist is refused by name, never imported; a damaged zip file is a ZipEntryError naming it."""
from __future__ import annotations

import io
import os
import pickle
import re
import struct
import zipfile
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import EXIT_PICKLE, CheckpointError
from ..manifest import DamagedCheckpointError


class PickleRefusedError(CheckpointError, ValueError):
    """A DeepSpeed file holds a Python global outside the allowlist; it is never unpickled."""

    exit_code = EXIT_PICKLE


class ZipEntryError(DamagedCheckpointError):
    """An entry of a torch.save zip file fails its CRC-32 or size check (a damaged file)."""


class Stub:
    """Stands in for a DeepSpeed class: keeps the constructor arguments (``int()`` gives the
    first, as for an enum) and the pickled state as attributes; runs no DeepSpeed code."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "Stub":
        obj = object.__new__(cls)
        obj.__dict__["_args"] = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_args"] = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots)
        if isinstance(state, dict):
            self.__dict__.update({k: v for k, v in state.items() if isinstance(k, str)})
        else:
            self.__dict__["_state"] = state

    def __int__(self) -> int:
        return int(self._args[0])

    def __repr__(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if k != "_args"}
        return f"{type(self).__qualname__}(args={self._args}, {fields})"


def _stand_in(path: str) -> type:
    module, name = path.rsplit(".", 1)
    return type(name, (Stub,), {"__module__": module, "__qualname__": name})


# Every DeepSpeed global in DeepSpeed 0.19's ZeRO-1/2/3 checkpoints (fp32, bf16; found by
# listing the GLOBAL opcodes of real checkpoints), plus the dynamic loss scaler its fp16
# optimizers save in the same place as LossScaler. torch's own tensor and storage globals
# (OrderedDict, torch.Size, _rebuild_tensor_v2, ...) are in torch's weights-only allowlist.
DEEPSPEED_GLOBALS: dict[str, type] = {p: _stand_in(p) for p in (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)}

_GLOBAL = re.compile(r"(?:GLOBAL|global|function|class)\s+'?([\w.]+)'?")


# what reading a damaged zip file can raise (zipfile's own checks, and torch's miniz reader)
ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, NotImplementedError,
              RuntimeError, struct.error, KeyError, IndexError, OverflowError)


def damaged(path: str, exc: BaseException) -> "ZipEntryError":
    """The error for zip file ``path`` whose structure could not be read (``exc``)."""
    msg = str(exc).split(". ")[0]  # torch's miniz messages go on for three sentences
    return ZipEntryError(f"{path}: damaged zip file, not readable as torch.save output "
                         f"({type(exc).__name__}: {msg})")


def check_zip(path: Any, entries: Sequence[str] | None = None, name: str | None = None) -> list[str]:
    """Read the entries of zip file ``path`` (a path or a binary file object; all entries, or
    those named) and check each one's CRC-32 and size against the central directory; return one
    message per damaged entry (or one for a directory that cannot be read), naming the file as
    ``name`` (default: ``path``)."""
    name = name or str(path)
    bad = []
    try:
        zf = zipfile.ZipFile(path)
        infos = zf.infolist() if entries is None else [zf.getinfo(e) for e in entries]
    except ZIP_ERRORS as exc:
        return [str(damaged(name, exc))]
    with zf:
        for info in infos:
            try:
                n = 0
                with zf.open(info) as f:
                    while chunk := f.read(1 << 22):
                        n += len(chunk)
                if n != info.file_size:
                    raise zipfile.BadZipFile(f"{n} bytes, the directory says {info.file_size}")
            except ZIP_ERRORS as exc:
                bad.append(f"{name}: zip entry {info.filename!r} is damaged ({type(exc).__name__}: {exc})")
    return bad


def is_zip(path: str) -> bool:
    """Whether ``path`` is a zip file (torch.save's format since torch 1.6); a zip file whose end
    records are damaged is a ZipEntryError (zipfile.is_zipfile raises on some of those)."""
    try:
        return zipfile.is_zipfile(path)
    except ZIP_ERRORS as exc:
        raise damaged(path, exc) from None


def zip_entries(path: str) -> list[tuple[str, int]]:
    """(entry name, size) of every entry of zip file ``path``."""
    try:
        with zipfile.ZipFile(path) as zf:
            return [(i.filename, i.file_size) for i in zf.infolist()]
    except ZIP_ERRORS as exc:
        raise damaged(path, exc) from None


def check_files(paths: Sequence[str], rank: int = 0, size: int = 1,
                exchange: Callable[[list[str]], list[list[str]]] | None = None) -> None:
    """Check every zip entry of ``paths``; with ``size`` > 1 this rank checks its share (by
    bytes) and ``exchange`` (an allgather) gives every rank every rank's findings, so every
    rank raises the same ZipEntryError."""
    work = []
    for p in paths:
        if is_zip(p):
            work += [(p, name, n) for name, n in zip_entries(p)]
    total, acc = sum(n for *_, n in work) or 1, 0
    mine: dict[str, list[str]] = {}
    for p, name, n in work:
        owner = min(size - 1, int((acc + n / 2) * size / total))
        acc += n
        if owner == rank:
            mine.setdefault(p, []).append(name)
    bad = [msg for p, names in mine.items() for msg in check_zip(p, names)]
    found = [m for part in exchange(bad) for m in part] if exchange is not None else bad
    if found:
        raise ZipEntryError("; ".join(found))


class Loader:
    """Loads DeepSpeed files with ``torch.load(weights_only=True)``, resolving the allowlisted
    DeepSpeed classes to stand-ins; any other global is refused, naming it. Tensors are
    memory-mapped, so a caller that touches a slice reads only that slice's pages. ``verify``
    checks every zip entry's CRC-32 first (pass False for files already checked)."""

    def __init__(self, verify: bool = True) -> None:
        self.verify = verify

    def load(self, path: str) -> Any:
        # torch's zip format (the default since torch 1.6) can be memory-mapped; older files not
        mmap = is_zip(path)
        if self.verify and mmap:
            bad = check_zip(path)
            if bad:
                raise ZipEntryError("; ".join(bad))
        allow = [(cls, name) for name, cls in DEEPSPEED_GLOBALS.items()]
        try:
            with torch.serialization.safe_globals(allow):
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            raise refused(path, exc, DEEPSPEED_GLOBALS, "the DeepSpeed classes a checkpoint contains") from None
        except ZIP_ERRORS as exc:
            raise damaged(path, exc) from None


def refused(path: str, exc: BaseException, allowed: Mapping[str, Any], which: str) -> "PickleRefusedError":
    """The error for a pickle in ``path`` that the weights-only unpickler refused (``exc``)."""
    m = _GLOBAL.search(str(exc))
    what = f"the global {m.group(1)}" if m else "an object that is neither a tensor nor plain data"
    return PickleRefusedError(
        f"{path} holds {what}, which is not one of {which} ({', '.join(sorted(allowed))}); refusing to "
        "unpickle it: unpickling can run arbitrary code")


def torch_value_globals() -> dict[str, Any]:
    """The globals of torch's weights-only allowlist that are values, not code: dtypes, layouts,
    memory formats, ``torch.Size``, ``collections.OrderedDict`` and the layout lookup."""
    from torch import _weights_only_unpickler

    keep = {"torch.Size", "torch.serialization._get_layout", "collections.OrderedDict"}
    return {name: obj for name, obj in _weights_only_unpickler._get_allowed_globals().items()
            if name in keep or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))}


class _Restricted(pickle.Unpickler):
    """Resolves a global only from ``allowed`` (name -> object); anything else is refused by
    name, never imported. No persistent ids (so no storages, no tensors)."""

    def __init__(self, data: bytes, allowed: Mapping[str, Any]) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in self.allowed:
            return self.allowed[full]
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {full} is not allowed")


def unpickle(data: bytes, path: str, allowed: Mapping[str, Any], which: str) -> Any:
    """A plain pickle (any protocol; not a torch.save file) whose globals may only be those in
    ``allowed`` (global name -> the object it resolves to) and torch's value globals (dtypes,
    ``torch.Size``...): anything else is refused naming the global (PickleRefusedError naming
    ``path`` and ``which``, what the allowlist is for). Damaged data is a DamagedCheckpointError."""
    table = {**torch_value_globals(), **allowed}
    try:
        return _Restricted(data, table).load()
    except pickle.UnpicklingError as exc:
        if _GLOBAL.search(str(exc)):
            raise refused(path, exc, allowed, which) from None
        raise DamagedCheckpointError(f"{path}: not a readable pickle ({exc})") from None
    except (EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError, OverflowError,
            struct.error, RecursionError, MemoryError) as exc:
        raise DamagedCheckpointError(f"{path}: not a readable pickle ({type(exc).__name__}: {exc})") from None
