"""The optional compiled check of remembered fast calls: build it, find it, load it.

``python -m mpicomm.build_native`` compiles ``_tensor_facts.cpp`` against the installed torch
(a C++ compiler and torch's headers; about 20 s) into a cache directory
(``MPICOMM_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/mpicomm/native`` or ``~/.cache/mpicomm/native``),
under a key of the source, the torch build and install path and the Python ABI.
``mpicomm.fastpath`` then loads it at import: its remembered-call check reads a tensor's six
facts in one C call (about 30 ns) instead of six Python reads (about 360 ns). Without it (never
built, another torch, ``MPICOMM_NATIVE=0``) the same check runs in Python: same answers, slower.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).with_name("_tensor_facts.cpp")
NAME = "_tensor_facts"
CACHE_VAR = "MPICOMM_NATIVE_CACHE"
SWITCH_VAR = "MPICOMM_NATIVE"  # "0": never load it

__all__ = ["cache_dir", "library_path", "load", "build"]


def cache_dir() -> Path:
    """Where built modules live (``MPICOMM_NATIVE_CACHE``, else the user's cache directory)."""
    explicit = os.environ.get(CACHE_VAR)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mpicomm" / "native"


def library_path(cache: Path | None = None) -> Path:
    """The module file built for this source, torch build and Python (it may not exist)."""
    import torch

    key = hashlib.sha256(SOURCE.read_bytes())
    key.update("\0".join([torch.__version__, str(torch.version.git_version), torch.__file__,
                          sys.version, str(sysconfig.get_config_var("EXT_SUFFIX"))]).encode())
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return (cache or cache_dir()) / key.hexdigest()[:20] / (NAME + suffix)


def load(cache: Path | None = None) -> ModuleType | None:
    """The built module when there is one for this torch and Python, else None (a file that
    is there but does not load gives a warning and None)."""
    if os.environ.get(SWITCH_VAR, "").strip() == "0":
        return None
    try:
        import torch

        path = library_path(cache)
        if not path.is_file():
            return None
        spec = importlib.util.spec_from_file_location(f"mpicomm.{NAME}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if module.torch_version != torch.__version__:
            raise ImportError(f"built for torch {module.torch_version}, "
                              f"running {torch.__version__}")
        return module
    except Exception as exc:  # noqa: BLE001 - any failure leaves the Python check in charge
        warnings.warn(f"mpicomm.native: not using {NAME} ({exc}); rebuild it with "
                      "`python -m mpicomm.build_native`", RuntimeWarning, stacklevel=2)
        return None


def _compile_command(out: Path, cxx: str) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    includes = cpp_extension.include_paths() + [sysconfig.get_paths()["include"]]
    libs = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ([cxx, "-O2", "-shared", "-fPIC", "-std=c++17", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f'-DMPICOMM_TORCH_VERSION="{torch.__version__}"']
            + [f"-I{p}" for p in includes] + [str(SOURCE), "-o", str(out)]
            + [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs]
            + ["-lc10", "-ltorch_python"])


def build(cache: Path | None = None, cxx: str | None = None) -> Path:
    """Compile the module for this torch and Python into the cache (nothing if it is there);
    return its path. Raises RuntimeError with the compiler's output when compiling fails."""
    path = library_path(cache)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    cxx = cxx or os.environ.get("CXX") or "c++"
    # compiled beside its final name, then renamed: ranks building at once never load half a file
    fd, tmp = tempfile.mkstemp(prefix=f".{NAME}-", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        command = _compile_command(Path(tmp), cxx)
        try:
            done = subprocess.run(command, capture_output=True, text=True)
        except OSError as exc:
            raise RuntimeError(f"mpicomm.native: cannot run the C++ compiler {cxx!r} ({exc}); "
                               "set CXX to one") from exc
        if done.returncode != 0:
            raise RuntimeError(f"mpicomm.native: compiling {SOURCE.name} failed "
                               f"(exit {done.returncode}):\n{' '.join(command)}\n"
                               f"{done.stderr[-4000:]}")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep a shared cache's other users out
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
