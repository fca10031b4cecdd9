"""Where a checkpoint lives on disk: working directory, commit, ``latest``, resolving a path, reading
and checking the manifest and the data file's checksums (no MPI; the callers run these on rank 0).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from typing import Sequence

import numpy as np

from . import checksum, commit
from .errors import CheckpointExistsError, ChecksumError
from .io import fsync_path, read_blocks
from .manifest import (DATA_NAME, INCOMPLETE_NAME, LATEST_NAME, MANIFEST_NAME, TMP_MARK, DamagedCheckpointError,
                       IncompleteCheckpointError, Manifest, ManifestError)

MAX_MANIFEST_BYTES = 1 << 30


def incomplete_reason(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` is an unfinished save, or None when nothing says so."""
    d = os.path.abspath(os.fspath(directory))
    base = os.path.basename(d)
    if os.path.lexists(os.path.join(d, INCOMPLETE_NAME)):
        return f"it holds an {INCOMPLETE_NAME} marker: its save did not finish (a rank died or failed while writing)"
    if base.startswith(".") and TMP_MARK in base:
        return "it is the working directory of a save that was never committed under its final name"
    if not os.path.lexists(os.path.join(d, MANIFEST_NAME)) and os.path.lexists(os.path.join(d, DATA_NAME)):
        return f"it has {DATA_NAME} but no {MANIFEST_NAME}: its save did not finish"
    return None


def _refuse_incomplete(d: str) -> None:
    why = incomplete_reason(d)
    if why is not None:
        raise IncompleteCheckpointError(
            f"{d} is an incomplete checkpoint and is never loaded: {why}. Load its parent directory to follow "
            f"'{LATEST_NAME}' to the last complete checkpoint, or delete it.")


def resolve(path: str | os.PathLike) -> str:
    """The checkpoint directory at ``path``, following a ``latest`` pointer in it if needed.
    Refuses (IncompleteCheckpointError) a save that did not finish."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise ManifestError(f"no checkpoint at {path}: it does not exist")
    if not os.path.isdir(path):
        raise ManifestError(f"no checkpoint at {path}: expected a directory, found a file")
    _refuse_incomplete(path)
    if os.path.isfile(os.path.join(path, MANIFEST_NAME)):
        return path
    latest = os.path.join(path, LATEST_NAME)
    if not os.path.isfile(latest):
        raise ManifestError(f"no checkpoint at {path}: expected {MANIFEST_NAME} or a {LATEST_NAME} pointer")
    with open(latest, "rb") as f:
        raw = f.read(4096)
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = ""
    target = os.path.normpath(os.path.join(path, name))
    if not name or os.sep in name or name in (".", "..") or os.path.dirname(target) != path:
        raise ManifestError(f"{latest}: expected the name of a checkpoint directory in {path}, got {raw[:60]!r}")
    if os.path.isdir(target):
        _refuse_incomplete(target)
    if os.path.isfile(os.path.join(target, MANIFEST_NAME)):
        return target
    raise ManifestError(f"{latest} names {name!r}, which has no {MANIFEST_NAME}")


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Read and check the manifest of the checkpoint at ``path`` (no MPI): it must parse, be
    of a format version this code reads, and describe a data file of the size found."""
    return read_manifest_text(path)[0]


def read_manifest_text(path: str | os.PathLike) -> tuple[Manifest, str]:
    """``read_manifest``, and the manifest's text as read (what ``load`` broadcasts: every
    other rank parses it with ``Manifest.from_json(text, checked=True)``)."""
    d = resolve(path)
    mpath = os.path.join(d, MANIFEST_NAME)
    if os.path.getsize(mpath) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{mpath}: over {MAX_MANIFEST_BYTES} bytes; not a manifest")
    with open(mpath, "rb") as f:
        raw = f.read()
    try:
        m = Manifest.from_json(raw)
        if set(m.files) != {DATA_NAME}:
            raise ManifestError(f"expected the data file {[DATA_NAME]}, manifest lists {sorted(m.files)}")
    except ManifestError as exc:
        raise type(exc)(f"{mpath}: {exc}") from None  # the same class (e.g. DamagedCheckpointError), file named
    dpath = os.path.join(d, DATA_NAME)
    want = int(m.files[DATA_NAME]["nbytes"])
    if not os.path.isfile(dpath):
        raise DamagedCheckpointError(f"{d}: {DATA_NAME} is missing (the manifest expects {want} bytes)")
    size = os.path.getsize(dpath)
    if size != want:
        raise DamagedCheckpointError(f"{dpath}: expected {want} bytes, found {size} "
                                     f"({'truncated' if size < want else 'longer than written'})")
    return m, raw.decode("utf-8")


def create_workdir(path: str, world_size: int, overwrite: bool) -> str:
    """Make the hidden working directory ``.<name>.tmp-<id>`` beside ``path``, marked INCOMPLETE."""
    if os.path.exists(path) and not overwrite:
        raise CheckpointExistsError(f"save: {path} exists (pass overwrite=True to replace it)")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}{TMP_MARK}{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp)
    with open(os.path.join(tmp, INCOMPLETE_NAME), "w") as f:
        f.write(json.dumps({"target": path, "world_size": world_size, "host": socket.gethostname(),
                            "pid": os.getpid(), "started": time.time()}) + "\n")
    return tmp


def write_latest(parent: str, name: str, sync: bool) -> None:
    """Point ``<parent>/latest`` at ``name`` (an atomic replace)."""
    tmp = os.path.join(parent, f".{LATEST_NAME}.tmp-{uuid.uuid4().hex[:12]}")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, os.path.join(parent, LATEST_NAME))
    if sync:
        fsync_path(parent, directory=True)


def commit_save(tmp: str, path: str, manifest: Manifest, block_crcs: Sequence[int], *, overwrite: bool,
                sync: bool, update_latest: bool) -> Manifest:
    """Finish a save whose data is written in ``tmp``: the data file's ``block_crcs``, the
    manifest (durable before the INCOMPLETE marker goes), then publish ``tmp`` under ``path``
    holding the parent's lock, and move ``latest``."""
    manifest.files[DATA_NAME]["crc32"] = list(block_crcs)
    manifest.validate()
    with open(os.path.join(tmp, MANIFEST_NAME), "w") as fh:
        fh.write(manifest.to_json())
        fh.flush()
        if sync:
            os.fsync(fh.fileno())
    os.unlink(os.path.join(tmp, INCOMPLETE_NAME))  # the manifest is durable: the save is complete
    if sync:
        fsync_path(tmp, directory=True)
    parent = os.path.dirname(path)
    with commit.dir_lock(parent):
        try:
            old = commit.publish(tmp, path, overwrite)
        except CheckpointExistsError:
            shutil.rmtree(tmp, ignore_errors=True)  # complete but never published: ours to remove
            raise
        if sync:
            fsync_path(parent, directory=True)
        if update_latest:
            write_latest(parent, os.path.basename(path), sync)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return manifest


def verify_data(ckdir: str, m: Manifest, parts: np.ndarray, counts: np.ndarray) -> None:
    """Check what the ranks read against the manifest's block checksums, from every rank's
    ``checksum.block_parts`` (XOR-ed, summed): a block read whole once is checked from them;
    one read in part (or, against the plan, more than once) is read whole here. A mismatch
    names the blocks and the tensors in them."""
    f = m.files[DATA_NAME]
    expected, fsize, block = f["crc32"], int(f["nbytes"]), m.block_size
    sizes = np.full(len(expected), block, np.int64)
    if len(sizes):
        sizes[-1] = fsize - (len(sizes) - 1) * block
    whole = np.flatnonzero(counts == sizes)
    bad = [int(b) for b in whole if int(parts[b]) ^ checksum.zeros_crc(int(sizes[b])) != expected[b]]
    partial = [int(b) for b in np.flatnonzero((counts != sizes) & (counts != 0))]
    if partial:
        crcs = read_blocks(os.path.join(ckdir, DATA_NAME), partial, block, fsize)
        bad += [b for b, c in zip(partial, crcs) if c != expected[b]]
    if bad:
        bad.sort()
        raise ChecksumError(f"load: {ckdir}/{DATA_NAME}: checksum mismatch in {len(bad)} "
                            f"block(s) of {block} bytes: {m.describe_blocks(bad)}")
