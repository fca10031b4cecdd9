"""The MPI library behind mpi4py: its ctypes handle, COMM_WORLD info and a version summary."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from typing import Any, Dict, Iterable, Optional

# libmpi.so.12 (MPICH, Intel MPI, MVAPICH), libmpi.so.40 (Open MPI), libmpi_cray.so, libmpich.so,
# libmpi_abi.so (MPI 5 ABI); not the Fortran/C++ bindings.
_LIB_RE = re.compile(r"^lib(mpi|mpich|mpi_cray|mpi_abi|mpi_gnu[_\d]*|mpi_intel[_\d]*)\.so(\.|$)")


def pick_library_path(mapped_paths: Iterable[str]) -> Optional[str]:
    """Choose the MPI C library among paths of loaded shared objects (None if absent)."""
    for path in mapped_paths:
        if _LIB_RE.match(os.path.basename(path)):
            return path
    return None


def _loaded_paths() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            return [line.split()[-1] for line in f if "/" in line]
    except OSError:
        return []


def mpi_library() -> Optional[Any]:
    """A ctypes handle on the MPI library mpi4py loaded (initialises MPI); None if not found."""
    from mpi4py import MPI  # noqa: F401 - loads (and initialises) the MPI library

    path = pick_library_path(_loaded_paths())
    candidates = [path] if path else []
    found = ctypes.util.find_library("mpi")
    if found:
        candidates.append(found)
    for name in candidates:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def library_path(lib: Any) -> str:
    """The file a ctypes handle was opened from, or '?'."""
    return getattr(lib, "_name", None) or "?"


def world_info() -> Optional[Dict[str, str]]:
    """COMM_WORLD's info keys as a dict (None when the call fails)."""
    from mpi4py import MPI

    try:
        info = MPI.COMM_WORLD.Get_info()
    except Exception:  # noqa: BLE001 - old MPI without Comm_get_info
        return None
    try:
        return {key: info.Get(key) or "" for key in info.keys()}
    finally:
        info.Free()


def clean(text: str) -> str:
    """An MPI library string without NUL bytes (Open MPI ends its version with one) or trailing whitespace."""
    return text.replace("\x00", "").rstrip()


def library_version() -> str:
    """MPI_Get_library_version's text, cleaned."""
    from mpi4py import MPI

    return clean(MPI.Get_library_version())


def library_line() -> str:
    """The first line of the MPI library's version text, whitespace runs collapsed."""
    lines = library_version().strip().splitlines()
    return " ".join(lines[0].split()) if lines else ""


def library_summary() -> Dict[str, str]:
    """Vendor, library version line and MPI standard version of the MPI in use."""
    from mpi4py import MPI

    vendor, version = MPI.get_vendor()
    return {
        "vendor": f"{vendor} {'.'.join(map(str, version))}",
        "library": library_line(),
        "standard": ".".join(map(str, MPI.Get_version())),
    }
