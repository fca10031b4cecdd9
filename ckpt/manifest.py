"""The checkpoint manifest: a versioned JSON description of every tensor's bytes (pure, no MPI)."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Sequence

from .errors import EXIT_DAMAGED, EXIT_INCOMPLETE, EXIT_USAGE, CheckpointError

FORMAT_NAME = "mpicomm-ckpt"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # 2 added state items (kind "item", the "state" section); 3: data.bin
                               # starts with a safetensors header (safetensors_header.py)
MANIFEST_NAME = "manifest.json"
DATA_NAME = "data.bin"
LATEST_NAME = "latest"
DEFAULT_BLOCK_SIZE = 4 << 20

KINDS = ("param", "master", "state", "item")

ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


INCOMPLETE_NAME = "INCOMPLETE"   # present while a save is writing; removed just before the commit
TMP_MARK = ".tmp-"                # a save's working directory is ``.<name>.tmp-<id>``


class ManifestError(CheckpointError, ValueError):
    """The manifest is missing, malformed, or of an unsupported version."""

    exit_code = EXIT_USAGE


class IncompleteCheckpointError(ManifestError):
    """The directory is a save that did not finish (its writer died or failed); never loaded."""

    exit_code = EXIT_INCOMPLETE


class DamagedCheckpointError(ManifestError):
    """A file of the checkpoint is missing or has the wrong size."""

    exit_code = EXIT_DAMAGED


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
    # saved from a DTensor: every distinct shard written, as per-dimension [start, stop) ranges of
    # the global tensor (dtensor_layout.as_json); the file holds the full tensor all the same
    boxes: Any = field(default=None, compare=False)

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
        return json.dumps(d, indent=1, allow_nan=True)

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
    def from_json(cls, text: str | bytes) -> "Manifest":
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
        try:
            params = [ParamInfo(p["name"], tuple(p["shape"]), p["dtype"], bool(p.get("buffer", False)))
                      for p in d["params"]]
            tensors = [TensorEntry(t["name"], int(t["param"]), t["kind"], tuple(t["shape"]), t["dtype"],
                                   t["file"], int(t["offset"]), int(t["nbytes"]), t.get("key"), t.get("boxes"))
                       for t in d["tensors"]]
            m = cls(world_size=int(d["world_size"]), stage=d["stage"], step=d["step"], params=params,
                    tensors=tensors, files=d["files"], optimizer=d.get("optimizer"),
                    extra=d.get("extra"), block_size=int(d["block_size"]),
                    checksum=d.get("checksum", "crc32"), info=d.get("info") or {}, state=d.get("state"),
                    version=version)
            if not isinstance(m.files, dict) or m.block_size <= 0:
                raise TypeError("'files' or 'block_size'")
            m.validate()
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"manifest lacks or mistypes field {exc}") from None
        return m

    def validate(self) -> None:
        """Check internal consistency: kinds, dtypes, sizes, and that tensors fit their files."""
        for t in self.tensors:
            if t.kind not in KINDS:
                raise ManifestError(f"tensor {t.name!r}: expected kind in {KINDS}, got {t.kind!r}")
            if t.dtype not in ITEMSIZE:
                raise ManifestError(f"tensor {t.name!r}: unsupported dtype {t.dtype!r}")
            if t.nbytes != t.numel * t.itemsize:
                raise ManifestError(f"tensor {t.name!r} ({t.kind}): expected {t.numel * t.itemsize} "
                                    f"bytes for shape {t.shape} {t.dtype}, got {t.nbytes}")
            if not 0 <= t.param < len(self.params) and not (t.kind == "item" and t.param == -1):
                raise ManifestError(f"tensor {t.name!r}: param index {t.param} out of range")
            f = self.files.get(t.file)
            if f is None:
                raise ManifestError(f"tensor {t.name!r}: unknown file {t.file!r}")
            if t.offset < 0 or t.offset + t.nbytes > int(f["nbytes"]):
                raise ManifestError(f"tensor {t.name!r}: bytes [{t.offset}, {t.offset + t.nbytes}) "
                                    f"outside file {t.file!r} of {f['nbytes']} bytes")
        for name, f in self.files.items():
            nblocks = -(-int(f["nbytes"]) // self.block_size)
            if len(f.get("crc32", [])) != nblocks:
                raise ManifestError(f"file {name!r}: expected {nblocks} block checksums, "
                                    f"got {len(f.get('crc32', []))}")


class Packer:
    """Assigns consecutive, unpadded byte offsets in one data file."""

    def __init__(self, file: str = DATA_NAME) -> None:
        self.file = file
        self.size = 0
        self.entries: list[TensorEntry] = []

    def add(self, name: str, param: int, kind: str, shape: Sequence[int], dtype: str,
            key: str | None = None, boxes: Any = None) -> TensorEntry:
        numel = math.prod(shape)
        e = TensorEntry(name, param, kind, tuple(int(s) for s in shape), dtype, self.file,
                        self.size, numel * ITEMSIZE[dtype], key, boxes)
        self.size += e.nbytes
        self.entries.append(e)
        return e

    def prepend(self, nbytes: int) -> None:
        """Make room for ``nbytes`` (a header) at the start of the file: every entry moves up."""
        self.entries = [replace(e, offset=e.offset + nbytes) for e in self.entries]
        self.size += nbytes

    def alias(self, of: TensorEntry, kind: str, key: str | None = None) -> TensorEntry:
        """An entry sharing the bytes of ``of`` (e.g. fp32 model weights equal to the masters)."""
        e = TensorEntry(of.name, of.param, kind, of.shape, of.dtype, of.file, of.offset, of.nbytes, key, of.boxes)
        self.entries.append(e)
        return e


def _entry_json(t: TensorEntry) -> dict[str, Any]:
    d = asdict(t)
    if d["boxes"] is None:
        del d["boxes"]
    return d


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


def dumps_params(entries: Iterable[ParamInfo]) -> list[dict]:
    return [asdict(p) for p in entries]
