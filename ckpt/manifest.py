"""The checkpoint manifest: a versioned JSON description of every tensor's bytes (pure, no MPI)."""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

from .errors import EXIT_DAMAGED, EXIT_INCOMPLETE, EXIT_USAGE, CheckpointError

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
        params = [ParamInfo(_str(p["name"], "params[].name"), _shape(p["shape"], "params[].shape"),
                            _str(p["dtype"], "params[].dtype"), _bool(p.get("buffer", False), "params[].buffer"))
                  for p in _list(d["params"], "params")]
        tensors = [TensorEntry(_str(t["name"], "tensors[].name"), _int(t["param"], "tensors[].param", -1),
                               _str(t["kind"], "tensors[].kind"), _shape(t["shape"], "tensors[].shape"),
                               _str(t["dtype"], "tensors[].dtype"), _str(t["file"], "tensors[].file"),
                               _int(t["offset"], "tensors[].offset"), _int(t["nbytes"], "tensors[].nbytes"),
                               _opt_str(t.get("key"), "tensors[].key"), t.get("boxes"),
                               _layout_rule(t.get("layout"), "tensors[].layout"))
                   for t in _list(d["tensors"], "tensors")]
        stage = d["stage"]
        if stage is not None:
            _int(stage, "stage")
        step = d["step"]
        if step is not None:
            _int(step, "step", None)
        checksum = d.get("checksum", "crc32")
        if checksum != "crc32":
            raise ManifestError(f"expected checksum 'crc32', got {checksum!r}")
        info = d.get("info") or {}
        if not isinstance(info, dict):
            raise ManifestError(f"expected 'info' an object, got {type(info).__name__}")
        return cls(world_size=_int(d["world_size"], "world_size", 1), stage=stage, step=step, params=params,
                   tensors=tensors, files=d["files"], optimizer=d.get("optimizer"), extra=d.get("extra"),
                   block_size=_int(d["block_size"], "block_size", 1), checksum=checksum, info=info,
                   state=d.get("state"), version=version)

    def validate(self) -> None:
        """Check internal consistency: kinds, dtypes, sizes, that tensors fit their files, and the
        optimizer and state sections' structure (what load reads from them)."""
        if not isinstance(self.files, dict):
            raise ManifestError(f"expected 'files' an object, got {type(self.files).__name__}")
        for name, f in self.files.items():
            if not isinstance(f, dict):
                raise ManifestError(f"file {name!r}: expected an object, got {type(f).__name__}")
            _int(f.get("nbytes"), f"files.{name}.nbytes")
            crcs = _list(f.get("crc32", []), f"files.{name}.crc32")
            nblocks = -(-int(f["nbytes"]) // self.block_size)
            if len(crcs) != nblocks:
                raise ManifestError(f"file {name!r}: expected {nblocks} block checksums, got {len(crcs)}")
            # one pass in C over the types, then the range (a file of 200,000 blocks: not 600,000 Python calls)
            if crcs and not (set(map(type, crcs)) == {int} and min(crcs) >= 0 and max(crcs) < 1 << 32):
                bad = next(c for c in crcs if type(c) is not int or not 0 <= c < 1 << 32)
                raise ManifestError(f"file {name!r}: expected block checksums in [0, 2**32), got {bad!r}")
        for p in self.params:
            if p.dtype not in ITEMSIZE:
                raise ManifestError(f"param {p.name!r}: unsupported dtype {p.dtype!r}")
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
            if (t.kind == "item") != (t.param == -1) or (t.kind in ("state", "item")) != (t.key is not None):
                raise ManifestError(f"tensor {t.name!r}: kind {t.kind!r} with param {t.param} and key {t.key!r}")
            f = self.files.get(t.file)
            if f is None:
                raise ManifestError(f"tensor {t.name!r}: unknown file {t.file!r}")
            if t.offset < 0 or t.offset + t.nbytes > int(f["nbytes"]):
                raise ManifestError(f"tensor {t.name!r}: bytes [{t.offset}, {t.offset + t.nbytes}) "
                                    f"outside file {t.file!r} of {f['nbytes']} bytes")
        if self.optimizer is not None:
            self._validate_optimizer()
        if self.state is not None:
            self._validate_state()

    def _validate_optimizer(self) -> None:
        o = self.optimizer
        if not isinstance(o, dict) or not isinstance(o.get("class"), str):
            raise ManifestError("'optimizer': expected an object with a 'class' name")
        groups = _list(o.get("param_groups"), "optimizer.param_groups")
        for gi, g in enumerate(groups):
            if not isinstance(g, dict):
                raise ManifestError(f"optimizer.param_groups[{gi}]: expected an object, got {type(g).__name__}")
            for i in _list(g.get("params", []), f"optimizer.param_groups[{gi}].params"):
                _int(i, f"optimizer.param_groups[{gi}].params[]", 0, len(self.params))
        scalars = o.get("scalars")  # every version writes it, {} when there are none
        if not isinstance(scalars, dict):
            raise ManifestError(f"optimizer.scalars: expected an object, got {type(scalars).__name__}")
        for i, per in scalars.items():
            if not isinstance(per, dict):
                raise ManifestError(f"optimizer.scalars[{i!r}]: expected an object, got {type(per).__name__}")
            for key, v in per.items():
                if not isinstance(v, dict) or "value" not in v or v.get("dtype") not in (None, *ITEMSIZE):
                    raise ManifestError(f"optimizer.scalars[{i!r}][{key!r}]: expected {{'value', 'dtype'}}, got {v!r}")
                if v.get("dtype") is not None and (isinstance(v["value"], bool) or
                                                   not isinstance(v["value"], (int, float))):
                    raise ManifestError(f"optimizer.scalars[{i!r}][{key!r}]: expected a number, got {v['value']!r}")

    def _validate_state(self) -> None:
        s = self.state
        if not isinstance(s, dict):
            raise ManifestError(f"'state': expected an object, got {type(s).__name__}")
        items = s.get("items", {})
        if not isinstance(items, dict):
            raise ManifestError(f"state.items: expected an object, got {type(items).__name__}")
        keys = {t.key for t in self.tensors if t.kind == "item"}
        entries = [(f"state.items[{n!r}]", e) for n, e in items.items()]
        if "optimizer" in s:
            entries.append(("state.optimizer", s["optimizer"]))
        for what, e in entries:
            if not isinstance(e, dict):
                raise ManifestError(f"{what}: expected an object, got {type(e).__name__}")
            parts = [(what, e)] if "value" in e else []
            if "ranks" in e:
                parts += [(f"{what}.ranks[{r}]", x) for r, x in enumerate(_list(e["ranks"], f"{what}.ranks"))]
            for w, part in parts:
                if not isinstance(part, dict):
                    raise ManifestError(f"{w}: expected an object, got {type(part).__name__}")
                names = _list(part.get("tensors", []), f"{w}.tensors")
                for k in names:
                    if k not in keys:
                        raise ManifestError(f"{w}: no tensor {k!r} in the manifest")
                _check_tree(part.get("value"), len(names), f"{w}.value")


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


def _layout_rule(v: Any, what: str) -> Any:
    """A DTensor layout rule read from a manifest: {"mesh": [sizes], "placements": [[kind, ...]]},
    one placement per mesh dimension ("shard" dim, "strided" dim split, or "replicate")."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ManifestError(f"{what}: expected an object, got {type(v).__name__}")
    mesh = [_int(x, f"{what}.mesh", 1) for x in _list(v.get("mesh"), f"{what}.mesh")]
    places = _list(v.get("placements"), f"{what}.placements")
    if len(places) != len(mesh):
        raise ManifestError(f"{what}: expected one placement per mesh dimension ({len(mesh)}), got {len(places)}")
    for p in places:
        ok = isinstance(p, list) and p and (p == ["replicate"] or (p[0] == "shard" and len(p) == 2)
                                             or (p[0] == "strided" and len(p) == 3))
        if not ok:
            raise ManifestError(f"{what}.placements: expected ['shard', dim], ['strided', dim, split] or "
                                f"['replicate'], got {p!r}")
        for x in p[1:]:
            _int(x, f"{what}.placements[]", 0)
    return v


def canonical_bytes(d: dict[str, Any]) -> bytes:
    """The manifest's JSON data in one fixed spelling (sorted keys, no spaces, ASCII): what its
    checksum covers, so that re-indenting the file changes nothing."""
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True).encode()


def manifest_crc(d: dict[str, Any]) -> str:
    """The CRC-32 of ``canonical_bytes(d)`` as 8 hex digits (``d`` without MANIFEST_CRC_FIELD)."""
    return f"{zlib.crc32(canonical_bytes(d)) & 0xFFFFFFFF:08x}"


def _int(v: Any, what: str, lo: int | None = 0, hi: int | None = None) -> int:
    """``v`` if it is an int (not a bool) in [lo, hi), else a ManifestError naming ``what``."""
    if not isinstance(v, int) or isinstance(v, bool) or (lo is not None and v < lo) or (hi is not None and v >= hi):
        rng = f" in [{lo}, {hi if hi is not None else 'inf'})" if lo is not None else ""
        raise ManifestError(f"{what}: expected an integer{rng}, got {v!r}")
    return v


def _typed(v: Any, what: str, kind: type, expected: str, got: Callable[[Any], str] = repr) -> Any:
    """``v`` if it is a ``kind``, else a ManifestError naming ``what``, ``expected`` and ``got(v)``."""
    if not isinstance(v, kind):
        raise ManifestError(f"{what}: expected {expected}, got {got(v)}")
    return v


def _str(v: Any, what: str) -> str:
    return _typed(v, what, str, "a string")


def _opt_str(v: Any, what: str) -> str | None:
    return None if v is None else _str(v, what)


def _bool(v: Any, what: str) -> bool:
    return _typed(v, what, bool, "true or false")


def _list(v: Any, what: str) -> list:
    return _typed(v, what, list, "a list", lambda x: type(x).__name__)


def _shape(v: Any, what: str) -> tuple[int, ...]:
    return tuple(_int(s, what) for s in _list(v, what))


_TREE_MARKS = ("@tensor", "@tuple", "@items", "@float")


def _check_tree(data: Any, ntensors: int, what: str, depth: int = 0) -> None:
    """``data`` is what ckpt.tree.encode writes, referring to tensors 0..ntensors-1 only."""
    if depth > 200:
        raise ManifestError(f"{what}: nested too deep")
    if isinstance(data, list):
        for v in data:
            _check_tree(v, ntensors, what, depth + 1)
        return
    if not isinstance(data, dict):
        return
    if len(data) == 1:
        (mark, inner), = data.items()
        if mark == "@tensor":
            _int(inner, f"{what} @tensor", 0, ntensors)
            return
        if mark == "@tuple":
            _check_tree(_list(inner, f"{what} @tuple"), ntensors, what, depth + 1)
            return
        if mark == "@items":
            for kv in _list(inner, f"{what} @items"):
                if not isinstance(kv, list) or len(kv) != 2:
                    raise ManifestError(f"{what} @items: expected [key, value] pairs, got {kv!r}")
                _check_tree(kv, ntensors, what, depth + 1)
                if not _hashable_key(kv[0]):
                    raise ManifestError(f"{what} @items: a key that cannot be a dict key: {kv[0]!r}")
            return
        if mark == "@float":
            try:
                float(_str(inner, f"{what} @float"))
            except ValueError:
                raise ManifestError(f"{what} @float: expected a float's repr, got {inner!r}") from None
            return
    for v in data.values():
        _check_tree(v, ntensors, what, depth + 1)


def _hashable_key(key: Any) -> bool:
    """Whether decoding ``key`` gives something a dict key can be (tree._hashable's rule)."""
    if isinstance(key, list):
        return all(_hashable_key(k) for k in key)
    if not isinstance(key, dict):
        return True
    if len(key) == 1 and ("@tensor" in key or "@float" in key):
        return True
    return len(key) == 1 and "@tuple" in key and all(_hashable_key(k) for k in key["@tuple"])


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
