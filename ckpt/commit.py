"""Publishing a finished save under its final name: atomically, and one committer at a time."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
import uuid
from typing import Iterator

from .errors import CheckpointExistsError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _load_renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _load_renameat2()


def exchange(a: str, b: str) -> bool:
    """Swap two existing paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False
    where the system or file system cannot, so that the caller falls back to two renames."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), b)


@contextlib.contextmanager
def dir_lock(directory: str) -> Iterator[None]:
    """Hold an exclusive flock on ``directory`` (released when the process dies, so a killed
    job never leaves a stale lock). Where flock is unsupported the rename checks still refuse
    a second commit of the same name."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                pass
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def publish(tmp: str, path: str, overwrite: bool) -> str | None:
    """Move the finished directory ``tmp`` to ``path`` (call under ``dir_lock`` of the parent).

    Without ``overwrite`` an existing ``path`` (for instance one that a concurrent job
    committed while this one was writing) is a CheckpointExistsError. With it, the old directory
    is swapped out atomically where possible; the return value is the directory now holding the old
    checkpoint (to delete), or None."""
    if os.path.lexists(path):
        if not overwrite:
            raise CheckpointExistsError(f"save: {path} exists (another save may have committed it while this one "
                                        "was writing); pass overwrite=True to replace it")
        if exchange(tmp, path):
            return tmp
        old = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old-{uuid.uuid4().hex[:12]}")
        os.rename(path, old)
    else:
        old = None
    try:
        os.rename(tmp, path)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise CheckpointExistsError(f"save: another save committed {path} at the same time; this one was "
                                        "not published") from None
        raise
    return old
