"""Export a checkpoint's model state as a standalone safetensors file (no MPI)."""
from __future__ import annotations

import os
import uuid

from .io import fsync_path, read_blocks
from .manifest import DATA_NAME, Manifest, TensorEntry
from .safetensors_header import encode

COPY_BYTES = 64 << 20


def _model_entries(m: Manifest) -> list[TensorEntry]:
    out = []
    for i, p in enumerate(m.params):
        e = m.find("param", i)
        if e is None:
            raise ValueError(f"the checkpoint holds no weights for {p.name!r}")
        out.append(e)
    return out


def _check_blocks(m: Manifest, fname: str, entries: list[TensorEntry]) -> None:
    from .errors import ChecksumError

    bs = m.block_size
    blocks = sorted({b for e in entries if e.nbytes
                     for b in range(e.offset // bs, (e.offset + e.nbytes - 1) // bs + 1)})
    want = m.files[DATA_NAME]["crc32"]
    got = read_blocks(fname, blocks, bs, int(m.files[DATA_NAME]["nbytes"]))
    bad = [b for b, c in zip(blocks, got) if c != want[b]]
    if bad:
        raise ChecksumError(f"{fname}: checksum mismatch in {m.describe_blocks(bad)}")


def export_safetensors(path: str | os.PathLike, out: str | os.PathLike, sync: bool = True) -> str:
    """Write the model state (parameters and buffers, under their ``model.state_dict()``
    names, in their saved dtypes) of the checkpoint at ``path`` to the safetensors file
    ``out``, after checking the checksums of the bytes it copies; tied names appear once.
    Written to a temporary name and renamed into place. Returns ``out``'s absolute path."""
    from .storage import read_manifest, resolve

    ckdir = resolve(path)
    m = read_manifest(ckdir)
    fname = os.path.join(ckdir, DATA_NAME)
    entries = _model_entries(m)
    _check_blocks(m, fname, entries)
    placed, pos = [], 0
    for e in entries:
        placed.append(TensorEntry(e.name, e.param, "param", e.shape, e.dtype, "out", pos, e.nbytes))
        pos += e.nbytes
    head = encode(placed, {"format": "pt"})
    out = os.path.abspath(os.fspath(out))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(fname, "rb") as src, open(tmp, "wb") as dst:
            dst.write(head)
            for e in entries:
                src.seek(e.offset)
                left = e.nbytes
                while left:
                    chunk = src.read(min(left, COPY_BYTES))
                    if not chunk:
                        raise EOFError(f"{fname}: ends inside {e.name!r} (bytes [{e.offset}, {e.offset + e.nbytes}))")
                    dst.write(chunk)
                    left -= len(chunk)
            dst.flush()
            if sync:
                os.fsync(dst.fileno())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if sync:
        fsync_path(os.path.dirname(out), directory=True)
    return out
