"""Load DeepSpeed's torch.save files: safely when they allow it, with pickle only when allowed."""
from __future__ import annotations

import os
import pickle
import re
import types
import zipfile
from typing import Any

import torch

from ..errors import EXIT_PICKLE, CheckpointError


class PickleRefusedError(CheckpointError, ValueError):
    """A DeepSpeed file needs full pickle loading (which can run code) and it was not allowed."""

    exit_code = EXIT_PICKLE


class Stub:
    """Stands in for a DeepSpeed class (LossScaler, ZeroStageEnum, fragment_address...): keeps
    the constructor arguments (``int()`` gives the first, as for an enum) and the state."""

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
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state

    def __int__(self) -> int:
        return int(self._args[0])

    def __repr__(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if k != "_args"}
        return f"{type(self).__qualname__}(args={self._args}, {fields})"


def _stub_class(module: str, name: str) -> type:
    return type(name, (Stub,), {"__module__": module, "__qualname__": name})


class _Unpickler(pickle.Unpickler):
    """Resolves DeepSpeed's classes to stubs: reading its files neither needs nor imports
    DeepSpeed (and runs none of its code)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "deepspeed" or module.startswith("deepspeed."):
            return _stub_class(module, name)
        return super().find_class(module, name)


# torch.load takes a "pickle module": anything with load and Unpickler.
_PICKLE = types.ModuleType("ckpt_deepspeed_pickle")
_PICKLE.Unpickler = _Unpickler  # type: ignore[attr-defined]
_PICKLE.load = lambda f, **kw: _Unpickler(f, **kw).load()  # type: ignore[attr-defined]
_PICKLE.__dict__["__name__"] = "pickle"


class Loader:
    """Loads files with ``torch.load(weights_only=True)``, falling back to full unpickling only
    when ``allow_pickle`` is true (numpy.load's convention). Tensors are memory-mapped, so a
    caller that touches a slice reads only that slice's pages."""

    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = bool(allow_pickle)
        self.needs_pickle = False

    def load(self, path: str) -> Any:
        # torch's zip format (the default since torch 1.6) can be memory-mapped; older files not
        mmap = zipfile.is_zipfile(path)
        if not self.needs_pickle:
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except pickle.UnpicklingError as exc:
                if not self.allow_pickle:
                    m = re.search(r"GLOBAL (\S+)", str(exc))
                    detail = f"e.g. {m.group(1)}" if m else "not only tensors and plain data"
                    raise PickleRefusedError(
                        f"{os.path.basename(path)} holds pickled Python objects ({detail}); "
                        f"loading it with pickle can run arbitrary code. Pass allow_pickle=True if you trust "
                        f"{os.path.dirname(path)}.") from None
                self.needs_pickle = True
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=_PICKLE)
