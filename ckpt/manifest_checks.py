"""What a valid manifest is: the kinds and dtypes it may name, the checks of its fields and
sections (types, ranges, that tensors fit their files), and the errors raised when one fails
(pure, no MPI). ``ckpt.manifest`` (the records and their JSON) reads a manifest through these.
"""
from __future__ import annotations

from typing import Any, Callable

from .errors import EXIT_DAMAGED, EXIT_INCOMPLETE, EXIT_USAGE, CheckpointError

KINDS = ("param", "master", "state", "item")

ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


class ManifestError(CheckpointError, ValueError):
    """The manifest is missing, malformed, or of an unsupported version."""

    exit_code = EXIT_USAGE


class IncompleteCheckpointError(ManifestError):
    """The directory is a save that did not finish (its writer died or failed); never loaded."""

    exit_code = EXIT_INCOMPLETE


class DamagedCheckpointError(ManifestError):
    """A file of the checkpoint is missing or has the wrong size."""

    exit_code = EXIT_DAMAGED


def validate_manifest(m: Any) -> None:
    """Check ``m``'s internal consistency: kinds, dtypes, sizes, that tensors fit their files, and
    the optimizer and state sections' structure (what load reads from them)."""
    if not isinstance(m.files, dict):
        raise ManifestError(f"expected 'files' an object, got {type(m.files).__name__}")
    for name, f in m.files.items():
        if not isinstance(f, dict):
            raise ManifestError(f"file {name!r}: expected an object, got {type(f).__name__}")
        int_field(f.get("nbytes"), f"files.{name}.nbytes")
        crcs = list_field(f.get("crc32", []), f"files.{name}.crc32")
        nblocks = -(-int(f["nbytes"]) // m.block_size)
        if len(crcs) != nblocks:
            raise ManifestError(f"file {name!r}: expected {nblocks} block checksums, got {len(crcs)}")
        # one pass in C over the types, then the range (a file of 200,000 blocks: not 600,000 Python calls)
        if crcs and not (set(map(type, crcs)) == {int} and min(crcs) >= 0 and max(crcs) < 1 << 32):
            bad = next(c for c in crcs if type(c) is not int or not 0 <= c < 1 << 32)
            raise ManifestError(f"file {name!r}: expected block checksums in [0, 2**32), got {bad!r}")
    for p in m.params:
        if p.dtype not in ITEMSIZE:
            raise ManifestError(f"param {p.name!r}: unsupported dtype {p.dtype!r}")
    for t in m.tensors:
        if t.kind not in KINDS:
            raise ManifestError(f"tensor {t.name!r}: expected kind in {KINDS}, got {t.kind!r}")
        if t.dtype not in ITEMSIZE:
            raise ManifestError(f"tensor {t.name!r}: unsupported dtype {t.dtype!r}")
        if t.nbytes != t.numel * t.itemsize:
            raise ManifestError(f"tensor {t.name!r} ({t.kind}): expected {t.numel * t.itemsize} "
                                f"bytes for shape {t.shape} {t.dtype}, got {t.nbytes}")
        if not 0 <= t.param < len(m.params) and not (t.kind == "item" and t.param == -1):
            raise ManifestError(f"tensor {t.name!r}: param index {t.param} out of range")
        if (t.kind == "item") != (t.param == -1) or (t.kind in ("state", "item")) != (t.key is not None):
            raise ManifestError(f"tensor {t.name!r}: kind {t.kind!r} with param {t.param} and key {t.key!r}")
        f = m.files.get(t.file)
        if f is None:
            raise ManifestError(f"tensor {t.name!r}: unknown file {t.file!r}")
        if t.offset < 0 or t.offset + t.nbytes > int(f["nbytes"]):
            raise ManifestError(f"tensor {t.name!r}: bytes [{t.offset}, {t.offset + t.nbytes}) "
                                f"outside file {t.file!r} of {f['nbytes']} bytes")
    if m.optimizer is not None:
        _check_optimizer(m)
    if m.state is not None:
        _check_state(m)


def _check_optimizer(m: Any) -> None:
    o = m.optimizer
    if not isinstance(o, dict) or not isinstance(o.get("class"), str):
        raise ManifestError("'optimizer': expected an object with a 'class' name")
    groups = list_field(o.get("param_groups"), "optimizer.param_groups")
    for gi, g in enumerate(groups):
        if not isinstance(g, dict):
            raise ManifestError(f"optimizer.param_groups[{gi}]: expected an object, got {type(g).__name__}")
        for i in list_field(g.get("params", []), f"optimizer.param_groups[{gi}].params"):
            int_field(i, f"optimizer.param_groups[{gi}].params[]", 0, len(m.params))
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


def _check_state(m: Any) -> None:
    s = m.state
    if not isinstance(s, dict):
        raise ManifestError(f"'state': expected an object, got {type(s).__name__}")
    items = s.get("items", {})
    if not isinstance(items, dict):
        raise ManifestError(f"state.items: expected an object, got {type(items).__name__}")
    keys = {t.key for t in m.tensors if t.kind == "item"}
    entries = [(f"state.items[{n!r}]", e) for n, e in items.items()]
    if "optimizer" in s:
        entries.append(("state.optimizer", s["optimizer"]))
    for what, e in entries:
        if not isinstance(e, dict):
            raise ManifestError(f"{what}: expected an object, got {type(e).__name__}")
        parts = [(what, e)] if "value" in e else []
        if "ranks" in e:
            parts += [(f"{what}.ranks[{r}]", x) for r, x in enumerate(list_field(e["ranks"], f"{what}.ranks"))]
        for w, part in parts:
            if not isinstance(part, dict):
                raise ManifestError(f"{w}: expected an object, got {type(part).__name__}")
            names = list_field(part.get("tensors", []), f"{w}.tensors")
            for k in names:
                if k not in keys:
                    raise ManifestError(f"{w}: no tensor {k!r} in the manifest")
            _check_tree(part.get("value"), len(names), f"{w}.value")


def layout_rule(v: Any, what: str) -> Any:
    """A DTensor layout rule read from a manifest: {"mesh": [sizes], "placements": [[kind, ...]]},
    one placement per mesh dimension ("shard" dim, "strided" dim split, or "replicate")."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ManifestError(f"{what}: expected an object, got {type(v).__name__}")
    mesh = [int_field(x, f"{what}.mesh", 1) for x in list_field(v.get("mesh"), f"{what}.mesh")]
    places = list_field(v.get("placements"), f"{what}.placements")
    if len(places) != len(mesh):
        raise ManifestError(f"{what}: expected one placement per mesh dimension ({len(mesh)}), got {len(places)}")
    for p in places:
        ok = isinstance(p, list) and p and (p == ["replicate"] or (p[0] == "shard" and len(p) == 2)
                                             or (p[0] == "strided" and len(p) == 3))
        if not ok:
            raise ManifestError(f"{what}.placements: expected ['shard', dim], ['strided', dim, split] or "
                                f"['replicate'], got {p!r}")
        for x in p[1:]:
            int_field(x, f"{what}.placements[]", 0)
    return v


def int_field(v: Any, what: str, lo: int | None = 0, hi: int | None = None) -> int:
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


def str_field(v: Any, what: str) -> str:
    return _typed(v, what, str, "a string")


def opt_str_field(v: Any, what: str) -> str | None:
    return None if v is None else str_field(v, what)


def bool_field(v: Any, what: str) -> bool:
    return _typed(v, what, bool, "true or false")


def list_field(v: Any, what: str) -> list:
    return _typed(v, what, list, "a list", lambda x: type(x).__name__)


def shape_field(v: Any, what: str) -> tuple[int, ...]:
    return tuple(int_field(s, what) for s in list_field(v, what))


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
            int_field(inner, f"{what} @tensor", 0, ntensors)
            return
        if mark == "@tuple":
            _check_tree(list_field(inner, f"{what} @tuple"), ntensors, what, depth + 1)
            return
        if mark == "@items":
            for kv in list_field(inner, f"{what} @items"):
                if not isinstance(kv, list) or len(kv) != 2:
                    raise ManifestError(f"{what} @items: expected [key, value] pairs, got {kv!r}")
                _check_tree(kv, ntensors, what, depth + 1)
                if not _hashable_key(kv[0]):
                    raise ManifestError(f"{what} @items: a key that cannot be a dict key: {kv[0]!r}")
            return
        if mark == "@float":
            try:
                float(str_field(inner, f"{what} @float"))
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


__all__ = ["ITEMSIZE", "KINDS", "DamagedCheckpointError", "IncompleteCheckpointError", "ManifestError", "bool_field",
           "int_field", "layout_rule", "list_field", "opt_str_field", "shape_field", "str_field", "validate_manifest"]
