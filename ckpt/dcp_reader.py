"""``DCPReader``: torch DCP's ``StorageReader`` over a ckpt checkpoint, so that
``dcp.load(state, storage_reader=ckpt.DCPReader(path))`` fills whatever state dict a DCP user
builds: ``model.state_dict()``, ``{"model": ..., "optim": ...}`` from ``get_state_dict`` (FQN
keys), FSDP2 / DTensor shards. Each requested box is read as the byte runs it covers in
``data.bin`` (never the whole tensor), and every checksum block those runs touch is read whole
once and checked against the manifest's CRC-32 before any of its bytes is used.

The metadata offers every tensor as one chunk (``data.bin`` holds full tensors) under these
names, ``P`` each model prefix (default "model" and none) and ``O`` each optimizer prefix
(default "optim" and "optimizer"): ``P.<name>`` for the model's state (tied names too),
``O.state.<name>.<key>`` for optimizer state tensors and 0-d scalars (``step``), and
``O.param_groups.<i>.<hyperparameter>`` with ``O.param_groups.<i>.params`` the parameter names,
as ``torch.distributed.checkpoint.state_dict.get_state_dict`` names them."""
from __future__ import annotations

import io
import math
import os

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .checksum import crc32
from .dtypes import DTYPES
from .errors import CheckpointError, ChecksumError
from .manifest import DATA_NAME, ITEMSIZE, Manifest, ManifestError, TensorEntry, like
from .storage import read_manifest, resolve


@dataclass(frozen=True)
class Source:
    """Where one item's data lies: ``nbytes`` bytes at ``offset`` in data.bin (a tensor of
    ``dtype`` and ``shape``), or ``value`` from the manifest (``offset`` -1): a 0-d tensor of
    ``dtype``, or any JSON value served as bytes (``dtype`` "")."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    value: Any = None


def byte_runs(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], itemsize: int
              ) -> tuple[np.ndarray, int]:
    """The box ``offsets`` + ``lengths`` of a row-major tensor of ``shape`` as contiguous byte
    runs: (start of every run relative to the tensor's first byte, in row-major order of the box;
    the length of each run). Trailing dims the box spans whole merge into one run."""
    n = len(shape)
    if n == 0:
        return np.zeros(1, np.int64), itemsize
    if any(int(x) == 0 for x in lengths):
        return np.zeros(0, np.int64), 0
    strides = [itemsize * math.prod(shape[d + 1:]) for d in range(n)]
    j = n  # dims j.. are spanned whole
    while j > 0 and int(offsets[j - 1]) == 0 and int(lengths[j - 1]) == int(shape[j - 1]):
        j -= 1
    if j == 0:
        return np.zeros(1, np.int64), itemsize * math.prod(shape)
    run = int(lengths[j - 1]) * strides[j - 1]
    starts = np.array([int(offsets[j - 1]) * strides[j - 1]], np.int64)
    for d in range(j - 2, -1, -1):  # outer dims, innermost first
        step = np.arange(int(offsets[d]), int(offsets[d]) + int(lengths[d]), dtype=np.int64) * strides[d]
        starts = (step[:, None] + starts[None, :]).reshape(-1)
    return starts, run


class DCPReader(StorageReader):
    """Reads a ckpt checkpoint for ``torch.distributed.checkpoint.load`` (see the module doc).

    ``path``: a checkpoint directory or a directory whose ``latest`` names one. Data is read with
    plain file I/O by each rank for its own plan; ``bytes_read`` counts what this reader read."""

    def __init__(self, path: str | os.PathLike, *, model_prefixes: Sequence[str] = ("model", ""),
                 optimizer_prefixes: Sequence[str] = ("optim", "optimizer")) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.model_prefixes = tuple(model_prefixes)
        self.optimizer_prefixes = tuple(optimizer_prefixes)
        self.bytes_read = 0
        self._m: Manifest | None = None
        self._dir = ""
        self._sources: dict[MetadataIndex, Source] = {}
        self._verified: set[int] = set()

    # -- StorageReader -------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self._m, self._sources, self._verified, self.bytes_read = None, {}, set(), 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            resolve(checkpoint_id)
        except (CheckpointError, OSError, TypeError):
            return False
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._open()
        md: dict[str, Any] = {}
        for index, src in self._sources.items():
            if src.dtype == "":
                md[index.fqn] = BytesStorageMetadata()
            else:
                shape = torch.Size(src.shape)
                md[index.fqn] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=DTYPES[src.dtype]), size=shape,
                    chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)])
        return Metadata(state_dict_metadata=md, storage_data=dict(self._sources),
                        storage_meta=StorageMeta(checkpoint_id=self._dir), version="1.0.0")

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._m is None:
            self._open()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with open(os.path.join(self._dir, DATA_NAME), "rb", buffering=0) as f:
            for req in plan.items:
                src = self._sources.get(req.storage_index)
                if src is None:
                    raise ManifestError(f"{self._dir}: DCP asked for {req.storage_index.fqn!r}, which the "
                                        "checkpoint does not hold")
                if req.type == LoadItemType.BYTE_IO:
                    buf = io.BytesIO()
                    torch.save(self._bytes_value(req.dest_index.fqn, src.value, planner), buf)
                    buf.seek(0)
                    planner.load_bytes(req, buf)
                    continue
                box = self._box(f, src, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if tuple(target.shape) != tuple(box.shape):
                    raise ManifestError(f"{self._dir}: {req.dest_index.fqn!r}: DCP's target has shape "
                                        f"{tuple(target.shape)}, the box read has {tuple(box.shape)}")
                target.copy_(box)
                planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- the metadata from our manifest ----------------------------------------------------------

    def _open(self) -> None:
        self._dir = resolve(self.path)
        self._m = m = read_manifest(self._dir)
        self._sources = dict(self._items(m))

    def _items(self, m: Manifest) -> Iterator[tuple[MetadataIndex, Source]]:
        aliases = m.info.get("aliases", {}) if isinstance(m.info.get("aliases"), dict) else {}
        tied: dict[str, list[str]] = {}
        for alias, first in aliases.items():
            tied.setdefault(first, []).append(alias)
        for i, p in enumerate(m.params):
            e = m.find("param", i) or m.find("master", i)
            if e is None:
                continue
            src = _tensor(e, p.shape)
            for name in [p.name] + tied.get(p.name, []):
                for prefix in self.model_prefixes:
                    yield _index(_join(prefix, name), src), src
        if not m.optimizer:
            return
        keys = m.state_keys()
        scalars = m.optimizer.get("scalars", {})
        for prefix in self.optimizer_prefixes:
            for gi, g in enumerate(m.optimizer["param_groups"]):
                for i in g.get("params", []):
                    name = m.params[i].name
                    for key in keys:
                        e = m.find("state", i, key)
                        if e is not None:
                            src = _tensor(e, m.params[i].shape)
                            yield _index(_join(prefix, f"state.{name}.{key}"), src), src
                    for key, d in scalars.get(str(i), {}).items():
                        src = Source(-1, 0, d["dtype"] or "", (), d["value"])
                        yield _index(_join(prefix, f"state.{name}.{key}"), src), src
                for k, v in g.items():
                    value = [m.params[i].name for i in v] if k == "params" else v
                    yield MetadataIndex(_join(prefix, f"param_groups.{gi}.{k}")), Source(-1, 0, "", (), value)

    @staticmethod
    def _bytes_value(fqn: str, value: Any, planner: LoadPlanner) -> Any:
        """A JSON value with the tuple-ness of what the state dict holds now (Adam's betas)."""
        current = getattr(planner, "state_dict", None)
        template = current.get(fqn) if isinstance(current, dict) else None
        return like(template, value) if template is not None else value

    # -- reading a box ---------------------------------------------------------------------------

    def _box(self, f, src: Source, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        dtype = DTYPES[src.dtype]
        if src.offset < 0:  # a 0-d scalar kept in the manifest
            return torch.tensor(src.value, dtype=dtype)
        if len(offsets) != len(src.shape) or any(int(o) < 0 or int(o) + int(n) > s
                                                 for o, n, s in zip(offsets, lengths, src.shape)):
            raise ManifestError(f"{self._dir}: DCP asked for box offsets {tuple(offsets)} lengths {tuple(lengths)} "
                                f"of a tensor of shape {src.shape}")
        out = torch.empty(tuple(int(n) for n in lengths), dtype=dtype)
        if not out.numel():
            return out
        raw = out.reshape(-1).view(torch.uint8).numpy()
        starts, run = byte_runs(src.shape, offsets, lengths, ITEMSIZE[src.dtype])
        pos = 0
        block = self._m.block_size
        held, data = -1, b""
        for start in (starts + src.offset).tolist():
            a, end = start, start + run
            while a < end:
                b = a // block
                if b != held:
                    held, data = b, self._block(f, b)
                lo = b * block
                stop = min(end, lo + len(data))
                raw[pos:pos + stop - a] = np.frombuffer(data, np.uint8, stop - a, a - lo)
                pos += stop - a
                a = stop
        return out

    def _block(self, f, b: int) -> bytes:
        """Block ``b`` of data.bin, read whole; its CRC-32 checked the first time it is read."""
        m = self._m
        fsize = int(m.files[DATA_NAME]["nbytes"])
        lo = b * m.block_size
        n = min(m.block_size, fsize - lo)
        f.seek(lo)
        data = f.read(n)
        self.bytes_read += len(data)
        fname = os.path.join(self._dir, DATA_NAME)
        if len(data) != n:
            raise ChecksumError(f"{fname}: expected {n} bytes at offset {lo} (block {b}), read {len(data)}: "
                                "the file is shorter than its manifest says")
        if b not in self._verified:
            if crc32(data) != m.files[DATA_NAME]["crc32"][b]:
                raise ChecksumError(f"{fname}: checksum mismatch in {m.describe_blocks([b])}")
            self._verified.add(b)
        return data


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _tensor(e: TensorEntry, shape: Sequence[int]) -> Source:
    """Entry ``e`` as a tensor of ``shape`` (ZeRO's state is stored flat; its elements are the same)."""
    shape = tuple(shape) if math.prod(shape) == e.numel else e.shape
    return Source(e.offset, e.nbytes, e.dtype, tuple(shape))


def _index(fqn: str, src: Source) -> MetadataIndex:
    return MetadataIndex(fqn, torch.Size([0] * len(src.shape)) if src.dtype else None)
