"""The safetensors header that starts every data file, so that the file is a valid safetensors
file (written by this project; the safetensors library is not needed). Pure, no MPI.

Layout: 8-byte little-endian header length N, N bytes of JSON (padded with spaces to a
multiple of 8), then the tensors, each at ``data_offsets`` counted from the byte after the
header, in order, without gaps or overlaps. Tensor names in the header:

- model state (parameters and buffers): its ``model.state_dict()`` name;
- fp32 master weights that are not also the model weights: ``optimizer/master/<name>``;
- optimizer state tensors: ``optimizer/state/<name>/<key>`` (e.g. ``.../exp_avg``);
- tensors of state items (``save(state=...)``): their manifest key, ``items/<name>/<i>``
  (``items/<name>@<rank>/<i>`` per rank; ``optimizer/optimizer/<i>`` for an optimizer's extras);
- any other kind of entry: ``<kind>/<name>`` (``/<key>`` appended when it has one).

Bytes stored once for two entries (fp32 model weights that are the ZeRO masters) appear once,
under the model name.
"""
from __future__ import annotations

import json
import os
import struct
from typing import TYPE_CHECKING, Iterable, Sequence

from .manifest import TensorEntry

if TYPE_CHECKING:
    from .io_plan import SavePlan

DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
          "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ALIGN = 8
MAX_HEADER = 100 << 20  # the safetensors library's limit


class HeaderError(ValueError):
    """A file does not start with a valid safetensors header."""


def tensor_key(e: TensorEntry) -> str:
    """The name of entry ``e`` in the safetensors header (see the module docstring)."""
    if e.kind == "param":
        return e.name
    if e.kind == "master":
        return f"optimizer/master/{e.name}"
    if e.kind == "state":
        return f"optimizer/state/{e.name}/{e.key}"
    if e.kind == "item" and e.key:
        return e.key
    return f"{e.kind}/{e.name}" + (f"/{e.key}" if e.key else "")


def _unique(entries: Iterable[TensorEntry]) -> list[TensorEntry]:
    """One entry per stored byte range (the model's name first), in file order."""
    first: dict[tuple, TensorEntry] = {}
    for e in entries:
        # an alias has the same bytes; empty tensors share offsets, so they also need the same tensor
        k = (e.file, e.offset, e.nbytes) if e.nbytes else (e.file, e.offset, e.param, e.key)
        if k not in first or (e.kind == "param" and first[k].kind != "param"):
            first[k] = e
    return sorted(first.values(), key=lambda e: (e.offset, e.nbytes))


def encode(entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None, base: int = 0) -> bytes:
    """The 8-byte length and the padded JSON header for ``entries``, whose offsets count from
    ``base`` (the data's first byte); they must cover [base, end) in order, without gaps."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos = base
    for e in _unique(entries):
        if e.offset != pos:
            raise ValueError(f"safetensors needs contiguous tensors: {e.name!r} ({e.kind}) starts at byte "
                             f"{e.offset}, expected {pos}")
        key = tensor_key(e)
        if key in header:
            raise ValueError(f"two tensors would be named {key!r} in the safetensors header")
        header[key] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape),
                       "data_offsets": [e.offset - base, e.offset - base + e.nbytes]}
        pos += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % ALIGN)
    return struct.pack("<Q", len(text)) + text


def header_size(entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None) -> int:
    """The bytes ``encode`` takes for ``entries`` (the same whatever the base offset, since the
    offsets written are relative to the data)."""
    return len(encode(entries, metadata, base=min((e.offset for e in entries), default=0)))


def decode(head: bytes, file_size: int | None = None) -> tuple[dict[str, dict], dict[str, str], int]:
    """Parse the start of a safetensors file: (tensors by name, metadata, offset of the data).
    ``head`` must hold at least the 8-byte length and the header."""
    if len(head) < 8:
        raise HeaderError(f"expected at least 8 bytes (the header length), got {len(head)}")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER or len(head) < 8 + n or (file_size is not None and 8 + n > file_size):
        raise HeaderError(f"header length {n} does not fit the file")
    try:
        header = json.loads(head[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HeaderError(f"the header is not UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise HeaderError(f"expected a JSON object as header, got {type(header).__name__}")
    meta = header.pop("__metadata__", None) or {}
    return header, meta, 8 + n


def read_header(path: str) -> tuple[dict[str, dict], dict[str, str], int]:
    """``decode`` the header of the safetensors file at ``path``."""
    with open(path, "rb") as f:
        first = f.read(8)
        if len(first) == 8:
            (n,) = struct.unpack("<Q", first)
            first += f.read(min(n, MAX_HEADER + 1))
    return decode(first, os.path.getsize(path))


def add_header(sp: "SavePlan", metadata: dict[str, str] | None = None) -> bytes:
    """Put the safetensors header in front of everything save plan ``sp`` packed: every entry
    and write moves up by the header's size, and the header itself is written at offset 0 as
    replicated data (an even share, like the model weights). Returns the header."""
    import torch

    from .byte_ranges import IOItem, shift

    head = encode(sp.packer.entries, metadata)
    sp.packer.prepend(len(head))
    sp.replicated = [IOItem(0, len(head), sp.buffer(torch.frombuffer(bytearray(head), dtype=torch.uint8)), 0)] \
        + shift(sp.replicated, len(head))
    sp.own = shift(sp.own, len(head))
    return head
