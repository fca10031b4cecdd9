"""The checkpoint manifest: a versioned JSON description of every tensor's bytes (pure, no MPI).

Here the records (``Manifest``, ``TensorEntry``, ``ParamInfo``, the ``Packer`` that lays tensors
out in the data file) and their JSON, its checksum included; what a valid manifest is, and the
errors for one that is not, are in ``ckpt.manifest_checks`` (re-exported here).
"""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Sequence

from .manifest_checks import (ITEMSIZE, KINDS, DamagedCheckpointError, IncompleteCheckpointError, ManifestError,
                              bool_field, int_field, layout_rule, list_field, opt_str_field, shape_field, str_field,
                              validate_manifest)

FORMAT_NAME = "mpicomm-ckpt"
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)  # 2 added state items (kind "item", the "state" section); 3: data.bin
                                  # starts with a safetensors header (safetensors_header.py); 4: the
                                  # manifest carries its own CRC-32 (MANIFEST_CRC_FIELD)
MANIFEST_CRC_FIELD = "manifest_crc32"  # CRC-32 of canonical_bytes() of the manifest without this field
MANIFEST_NAME = "manifest.json"
DATA_NAME = "data.bin"
LATEST_NAME = "latest"
DEFAULT_BLOCK_SIZE = 4 << 20

INCOMPLETE_NAME = "INCOMPLETE"   # present while a save is writing; removed just before the commit
TMP_MARK = ".tmp-"                # a save's working directory is ``.<name>.tmp-<id>``


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: ``kind`` is "param" (model state), "master" (fp32 master
    weights), "state" (optimizer state ``key``), or "item" (a tensor of a state item, ``key``
    its unique name, ``param`` -1); ``param`` indexes ``Manifest.params``."""

    name: str
    param: int
    kind: str
    shape: tuple[int, ...]
    dtype: str
    file: str
    offset: int
    nbytes: int
    key: str | None = None
    # saved from a DTensor by manifests before the layout rule: every distinct shard written, as
    # per-dimension [start, stop) ranges of the global tensor; the file holds the full tensor all the same
    boxes: Any = field(default=None, compare=False)
    # saved from a DTensor: its layout rule (dtensor_layout.Sharding.rule: mesh shape, placements),
    # which gives every shard; the file holds the full tensor all the same
    layout: Any = field(default=None, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class ParamInfo:
    """One entry of the model's state (a parameter or a persistent buffer), in order."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    buffer: bool = False


@dataclass
class Manifest:
    """Everything needed to load a checkpoint at any world size, stage or optimizer layout."""

    world_size: int
    stage: int | None
    step: int | None
    params: list[ParamInfo]
    tensors: list[TensorEntry]
    files: dict[str, dict[str, Any]]
    optimizer: dict[str, Any] | None = None
    extra: Any = None
    block_size: int = DEFAULT_BLOCK_SIZE
    checksum: str = "crc32"
    info: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] | None = None   # state items and optimizer extras (see ckpt.items)
    version: int = FORMAT_VERSION

    def find(self, kind: str, param: int, key: str | None = None) -> TensorEntry | None:
        """The entry of ``kind`` (and optimizer state ``key``) for parameter index ``param``."""
        return self._index().get((kind, param, key))

    def state_keys(self) -> list[str]:
        """Optimizer state keys stored as tensors, in first-seen order."""
        seen: dict[str, None] = {}
        for t in self.tensors:
            if t.kind == "state" and t.key is not None:
                seen.setdefault(t.key, None)
        return list(seen)

    def param_index(self) -> dict[str, int]:
        return {p.name: i for i, p in enumerate(self.params)}

    def _index(self) -> dict[tuple[str, int, str | None], TensorEntry]:
        idx = getattr(self, "_idx", None)
        if idx is None:
            idx = {(t.kind, t.param, t.key): t for t in self.tensors}
            object.__setattr__(self, "_idx", idx)
        return idx

    def to_json(self) -> str:
        d = {
            "format": FORMAT_NAME,
            "version": self.version,
            "world_size": self.world_size,
            "stage": self.stage,
            "step": self.step,
            "block_size": self.block_size,
            "checksum": self.checksum,
            "params": [asdict(p) for p in self.params],
            "optimizer": self.optimizer,
            "tensors": [_entry_json(t) for t in self.tensors],
            "files": self.files,
            "extra": self.extra,
            "info": self.info,
            "state": self.state,
        }
        text = json.dumps(d, indent=1, allow_nan=True)
        if self.version < 4:
            return text
        # the checksum of what a reader parses (e.g. int keys come back as strings), in front
        crc = manifest_crc(json.loads(text))
        return json.dumps({"format": FORMAT_NAME, MANIFEST_CRC_FIELD: crc, **d}, indent=1, allow_nan=True)

    def blocks_of(self, t: TensorEntry) -> range:
        """The checksum blocks that hold tensor ``t``'s bytes."""
        if not t.nbytes:
            return range(0)
        return range(t.offset // self.block_size, (t.offset + t.nbytes - 1) // self.block_size + 1)

    def describe_blocks(self, blocks: Iterable[int], file: str = DATA_NAME, limit: int = 10) -> str:
        """"block 3 (bytes [a, b)): 'w' master, 'w' state exp_avg; ..." for bad-block messages."""
        parts = []
        blocks = sorted(set(blocks))
        for b in blocks[:limit]:
            lo = b * self.block_size
            hi = min(lo + self.block_size, int(self.files[file]["nbytes"]))
            held = []
            for t in self.tensors:
                if t.file == file and t.nbytes and t.offset < hi and t.offset + t.nbytes > lo:
                    what = f"{t.name!r} {t.kind}" + (f" {t.key}" if t.key else "")
                    if what not in held:
                        held.append(what)
            parts.append(f"block {b} (bytes [{lo}, {hi})) holding {', '.join(held) or 'no tensor'}")
        more = f"; and {len(blocks) - limit} more" if len(blocks) > limit else ""
        return "; ".join(parts) + more

    @classmethod
    def from_json(cls, text: str | bytes, checked: bool = False) -> "Manifest":
        """Parse and check a manifest: its format and version, every field's type and range,
        that its tensors fit their files, and (version 4 on) its own CRC-32. Any problem raises a
        ManifestError (DamagedCheckpointError for a checksum mismatch).

        ``checked``: ``text`` is what this function already accepted on another rank (``load``'s
        rank 0 reads and checks the file, then broadcasts its bytes): parse it without the checks,
        which would find what they found there (no CRC, no field or range checks)."""
        if checked:
            d = json.loads(text)
            return cls._from_dict(d, d["version"], checked=True)
        if isinstance(text, (bytes, bytearray)):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError:
                hint = " (it looks like a pickle, which ckpt never loads)" if text[:1] == b"\x80" else ""
                raise ManifestError(f"manifest is not UTF-8 JSON text: starts with {bytes(text[:8])!r}{hint}") \
                    from None
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ManifestError(f"manifest is not valid JSON: {exc}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise ManifestError(f"expected format {FORMAT_NAME!r}, got {got!r}")
        version = d.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            raise ManifestError(f"expected format version {FORMAT_VERSION}, got {version}: the checkpoint "
                                "was written by a newer ckpt; upgrade mpicomm to read it")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise ManifestError(f"expected format version in {READABLE_VERSIONS}, got {version!r}")
        stored = d.get(MANIFEST_CRC_FIELD)
        computed = manifest_crc({k: v for k, v in d.items() if k != MANIFEST_CRC_FIELD})  # before any defaults
        try:
            m = cls._from_dict(d, version)
            m.validate()
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
            raise ManifestError(f"manifest lacks or mistypes field {exc}") from None
        if stored is None and version >= 4:
            raise DamagedCheckpointError(f"manifest lacks its checksum field {MANIFEST_CRC_FIELD!r} (format "
                                         f"version {version} always has it): it was edited or damaged")
        if stored is not None and stored != computed:
            raise DamagedCheckpointError(f"manifest fails its own checksum ({MANIFEST_CRC_FIELD} {stored!r}, computed "
                                         f"{computed!r}): it was changed or damaged after the save")
        return m

    @classmethod
    def _from_dict(cls, d: dict[str, Any], version: int, checked: bool = False) -> "Manifest":
        if checked:  # the same objects as below, without the type checks
            return cls(world_size=d["world_size"], stage=d["stage"], step=d["step"], params=[
                ParamInfo(p["name"], tuple(p["shape"]), p["dtype"], p.get("buffer", False)) for p in d["params"]],
                tensors=[TensorEntry(t["name"], t["param"], t["kind"], tuple(t["shape"]), t["dtype"], t["file"],
                                     t["offset"], t["nbytes"], t.get("key"), t.get("boxes"), t.get("layout"))
                         for t in d["tensors"]],
                files=d["files"], optimizer=d.get("optimizer"), extra=d.get("extra"), block_size=d["block_size"],
                checksum=d.get("checksum", "crc32"), info=d.get("info") or {}, state=d.get("state"), version=version)
        params = [ParamInfo(str_field(p["name"], "params[].name"), shape_field(p["shape"], "params[].shape"),
                            str_field(p["dtype"], "params[].dtype"),
                            bool_field(p.get("buffer", False), "params[].buffer"))
                  for p in list_field(d["params"], "params")]
        tensors = [TensorEntry(str_field(t["name"], "tensors[].name"), int_field(t["param"], "tensors[].param", -1),
                               str_field(t["kind"], "tensors[].kind"), shape_field(t["shape"], "tensors[].shape"),
                               str_field(t["dtype"], "tensors[].dtype"), str_field(t["file"], "tensors[].file"),
                               int_field(t["offset"], "tensors[].offset"), int_field(t["nbytes"], "tensors[].nbytes"),
                               opt_str_field(t.get("key"), "tensors[].key"), t.get("boxes"),
                               layout_rule(t.get("layout"), "tensors[].layout"))
                   for t in list_field(d["tensors"], "tensors")]
        stage = d["stage"]
        if stage is not None:
            int_field(stage, "stage")
        step = d["step"]
        if step is not None:
            int_field(step, "step", None)
        checksum = d.get("checksum", "crc32")
        if checksum != "crc32":
            raise ManifestError(f"expected checksum 'crc32', got {checksum!r}")
        info = d.get("info") or {}
        if not isinstance(info, dict):
            raise ManifestError(f"expected 'info' an object, got {type(info).__name__}")
        return cls(world_size=int_field(d["world_size"], "world_size", 1), stage=stage, step=step, params=params,
                   tensors=tensors, files=d["files"], optimizer=d.get("optimizer"), extra=d.get("extra"),
                   block_size=int_field(d["block_size"], "block_size", 1), checksum=checksum, info=info,
                   state=d.get("state"), version=version)

    def validate(self) -> None:
        """Check internal consistency: kinds, dtypes, sizes, that tensors fit their files, and the
        optimizer and state sections' structure (what load reads from them)."""
        validate_manifest(self)


class Packer:
    """Assigns consecutive, unpadded byte offsets in one data file."""

    def __init__(self, file: str = DATA_NAME) -> None:
        self.file = file
        self.size = 0
        self.entries: list[TensorEntry] = []

    def add(self, name: str, param: int, kind: str, shape: Sequence[int], dtype: str,
            key: str | None = None, layout: Any = None) -> TensorEntry:
        numel = math.prod(shape)
        e = TensorEntry(name, param, kind, tuple(int(s) for s in shape), dtype, self.file,
                        self.size, numel * ITEMSIZE[dtype], key, layout=layout)
        self.size += e.nbytes
        self.entries.append(e)
        return e

    def prepend(self, nbytes: int) -> None:
        """Make room for ``nbytes`` (a header) at the start of the file: every entry moves up."""
        self.entries = [replace(e, offset=e.offset + nbytes) for e in self.entries]
        self.size += nbytes

    def alias(self, of: TensorEntry, kind: str, key: str | None = None) -> TensorEntry:
        """An entry sharing the bytes of ``of`` (e.g. fp32 model weights equal to the masters)."""
        e = TensorEntry(of.name, of.param, kind, of.shape, of.dtype, of.file, of.offset, of.nbytes, key, of.boxes,
                        of.layout)
        self.entries.append(e)
        return e


def _entry_json(t: TensorEntry) -> dict[str, Any]:
    d = asdict(t)
    for k in ("boxes", "layout"):
        if d[k] is None:
            del d[k]
    return d


def canonical_bytes(d: dict[str, Any]) -> bytes:
    """The manifest's JSON data in one fixed spelling (sorted keys, no spaces, ASCII): what its
    checksum covers, so that re-indenting the file changes nothing."""
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True).encode()


def manifest_crc(d: dict[str, Any]) -> str:
    """The CRC-32 of ``canonical_bytes(d)`` as 8 hex digits (``d`` without MANIFEST_CRC_FIELD)."""
    return f"{zlib.crc32(canonical_bytes(d)) & 0xFFFFFFFF:08x}"


def jsonable(value: Any, what: str) -> Any:
    """Return ``value`` as plain JSON data (tuples become lists), or raise naming ``what``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v, what) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{what}: expected string keys, got {type(k).__name__} {k!r}")
            out[k] = jsonable(v, f"{what}.{k}")
        return out
    raise TypeError(f"{what}: expected JSON-able data (None, bool, int, float, str, list, dict), "
                    f"got {type(value).__name__}")


def like(template: Any, value: Any) -> Any:
    """Give JSON ``value`` back the tuple-ness of ``template`` (e.g. Adam's ``betas``)."""
    if isinstance(template, tuple) and isinstance(value, list):
        return tuple(like(t, v) for t, v in zip(template, value)) if len(template) == len(value) \
            else tuple(value)
    return value



__all__ = ["DATA_NAME", "DEFAULT_BLOCK_SIZE", "FORMAT_NAME", "FORMAT_VERSION", "INCOMPLETE_NAME", "ITEMSIZE", "KINDS",
           "LATEST_NAME", "MANIFEST_CRC_FIELD", "MANIFEST_NAME", "READABLE_VERSIONS", "TMP_MARK",
           "DamagedCheckpointError", "IncompleteCheckpointError", "Manifest", "ManifestError", "Packer", "ParamInfo",
           "TensorEntry", "canonical_bytes", "jsonable", "like", "manifest_crc"]
