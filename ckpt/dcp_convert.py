"""``from_dcp``: a torch DCP checkpoint directory (``.metadata`` and ``__<rank>_<n>.distcp``
files, as ``FileSystemWriter`` writes them) into a ckpt checkpoint.

``.metadata`` is a pickle: it is read by torch's weights-only unpickler with an allowlist of
exactly DCP's metadata classes (``DCP_GLOBALS``); any other global is refused by name, never
imported. Every item is read at the offset and length the metadata gives; DCP writes each as a
``torch.save`` zip, whose entries' CRC-32 are checked before it is loaded weights-only. Sharded
tensors (FSDP2, DTensor) are put together from their chunks, which must tile them exactly.

The state dict saved is mapped by its shape: a top-level dict of tensors is the model; an entry
holding ``state`` and ``param_groups`` (keyed by parameter names, as ``get_state_dict`` builds
it) the optimizer; ``{"model": ..., <optimizer>: ..., "step": int, ...}`` the usual layout, any
other top-level entry a state item (``ckpt.load(state={name: ...})``)."""
from __future__ import annotations

import io
import math
import os
import pathlib
import pickle
import re
from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

import mpicomm

from .api import save
from .collective import Collective
from .deepspeed.pickles import ZIP_ERRORS, check_zip, damaged, refused, unpickle
from .errors import CheckpointNotFoundError, IncompatibleStateError
from .manifest import DamagedCheckpointError, Manifest, ManifestError

METADATA_NAME = ".metadata"


def _path_str(*parts: Any) -> str:
    """Stands in for pathlib paths in the metadata (``storage_meta.checkpoint_id``): a string."""
    return str(pathlib.PurePath(*[str(p) for p in parts]))


# Every global in the .metadata that torch 2.13's FileSystemWriter writes (found by listing the
# GLOBAL opcodes of real ones), beyond torch's own weights-only allowlist (torch.Size, dtypes,
# layouts). Nothing else is ever resolved.
DCP_GLOBALS: dict[str, Any] = {
    "torch.distributed.checkpoint.metadata.Metadata": dcp_md.Metadata,
    "torch.distributed.checkpoint.metadata.MetadataIndex": dcp_md.MetadataIndex,
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata": dcp_md.TensorStorageMetadata,
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata": dcp_md.BytesStorageMetadata,
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata": dcp_md.ChunkStorageMetadata,
    "torch.distributed.checkpoint.metadata.TensorProperties": dcp_md.TensorProperties,
    "torch.distributed.checkpoint.metadata.StorageMeta": dcp_md.StorageMeta,
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING": dcp_md._MEM_FORMAT_ENCODING,
    "torch.distributed.checkpoint.filesystem._StorageInfo": dcp_fs._StorageInfo,
    "pathlib.PosixPath": _path_str,
    "pathlib._local.PosixPath": _path_str,
}
_WHICH = "torch DCP's metadata classes"
_FILE = re.compile(r"[\w.\-]+")


def read_metadata(folder: str) -> dcp_md.Metadata:
    """The checked ``.metadata`` of DCP checkpoint ``folder``."""
    path = os.path.join(folder, METADATA_NAME)
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"{folder}: no torch DCP checkpoint here (no {METADATA_NAME} file)")
    with open(path, "rb") as f:
        md = unpickle(f.read(), path, DCP_GLOBALS, _WHICH)
    if not isinstance(md, dcp_md.Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise ManifestError(f"{path}: expected DCP's Metadata with state_dict_metadata and storage_data, "
                            f"got {type(md).__name__}")
    return md


def _item(folder: str, md: dcp_md.Metadata, index: dcp_md.MetadataIndex) -> Any:
    """One item's value: its bytes (a torch.save zip) checked and loaded weights-only."""
    info = md.storage_data.get(index)
    if not isinstance(info, dcp_fs._StorageInfo):
        raise ManifestError(f"{folder}/{METADATA_NAME}: no storage entry for {index.fqn!r} at {index.offset}")
    name = info.relative_path
    if not isinstance(name, str) or not _FILE.fullmatch(name) or name in (".", ".."):
        raise ManifestError(f"{folder}/{METADATA_NAME}: {index.fqn!r} lies in {name!r}; expected a file name")
    if getattr(info, "transform_descriptors", None):
        raise IncompatibleStateError(f"{folder}: {index.fqn!r} was written through DCP extensions "
                                     f"{list(info.transform_descriptors)}; only plain FileSystemWriter "
                                     "checkpoints convert")
    path = os.path.join(folder, name)
    if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0 and info.length > 0):
        raise ManifestError(f"{folder}/{METADATA_NAME}: {index.fqn!r}: bad offset {info.offset!r} or length "
                            f"{info.length!r}")
    try:
        with open(path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
    except OSError as exc:
        raise DamagedCheckpointError(f"{path}: cannot read {index.fqn!r}: {exc}") from None
    if len(raw) != info.length:
        raise DamagedCheckpointError(f"{path}: expected {info.length} bytes at offset {info.offset} for "
                                     f"{index.fqn!r}, the file ends after {len(raw)}")
    where = f"{path} (item {index.fqn!r} at offset {info.offset})"
    if raw[:4] != b"PK\x03\x04":
        raise DamagedCheckpointError(f"{where}: expected a torch.save zip (DCP's FileSystemWriter with "
                                     f"serialization_format TORCH_SAVE writes every item so), found {raw[:8]!r}")
    bad = check_zip(io.BytesIO(raw), name=where)
    if bad:
        raise DamagedCheckpointError("; ".join(bad))
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise refused(where, exc, {}, "tensors and plain data (what DCP saves)") from None
    except ZIP_ERRORS as exc:
        raise damaged(where, exc) from None


def _tensor(folder: str, md: dcp_md.Metadata, fqn: str, tm: dcp_md.TensorStorageMetadata) -> torch.Tensor:
    """A whole tensor put together from its saved chunks (which must tile it exactly)."""
    dtype = tm.properties.dtype
    shape = tuple(int(s) for s in tm.size)
    out = torch.empty(shape, dtype=dtype)
    covered = 0
    boxes = []
    for c in tm.chunks:
        off, size = tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)
        if len(off) != len(shape) or len(size) != len(shape) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(off, size, shape)):
            raise ManifestError(f"{folder}/{METADATA_NAME}: {fqn!r}: chunk at {off} of {size} lies outside "
                                f"shape {shape}")
        for prev in boxes:
            if all(a < pa + pn and pa < a + n for a, n, pa, pn in zip(off, size, *prev)) and math.prod(size):
                raise ManifestError(f"{folder}/{METADATA_NAME}: {fqn!r}: chunks at {off} and {prev[0]} overlap")
        boxes.append((off, size))
        t = _item(folder, md, dcp_md.MetadataIndex(fqn, torch.Size(off)))
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != size or t.dtype != dtype:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ManifestError(f"{folder}: {fqn!r}: chunk at {off} holds {got}, the metadata says {dtype} {size}")
        out[tuple(slice(o, o + n) for o, n in zip(off, size))] = t
        covered += math.prod(size)
    if covered != math.prod(shape):
        raise ManifestError(f"{folder}/{METADATA_NAME}: {fqn!r}: its chunks cover {covered} of "
                            f"{math.prod(shape)} elements")
    return out


def read_dcp(folder: str | os.PathLike) -> dict[str, Any]:
    """Every entry of the DCP checkpoint in ``folder`` as the nested state dict that was saved
    (full tensors on the CPU; lists and dicts rebuilt from DCP's flattening paths)."""
    folder = os.path.abspath(os.fspath(folder))
    md = read_metadata(folder)
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    out: dict[str, Any] = {}
    for fqn, sm in md.state_dict_metadata.items():
        if isinstance(sm, dcp_md.TensorStorageMetadata):
            value = _tensor(folder, md, fqn, sm)
        elif isinstance(sm, dcp_md.BytesStorageMetadata):
            value = _item(folder, md, dcp_md.MetadataIndex(fqn))
        else:
            raise ManifestError(f"{folder}/{METADATA_NAME}: {fqn!r}: unknown storage kind {type(sm).__name__}")
        path = paths.get(fqn, (fqn,))
        if not isinstance(path, tuple) or not path or not all(isinstance(k, (str, int)) for k in path):
            raise ManifestError(f"{folder}/{METADATA_NAME}: {fqn!r}: bad planner path {path!r}")
        _put(out, path, value, fqn)
    return out


def _put(root: dict, path: tuple, value: Any, fqn: str) -> None:
    node: Any = root
    for key, nxt in zip(path[:-1], path[1:]):
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


# -- mapping the state dict onto a model and an optimizer ----------------------------------------

def _is_optimizer(v: Any) -> bool:
    return isinstance(v, dict) and isinstance(v.get("state"), dict) and isinstance(v.get("param_groups"), list)


def _is_model(v: Any) -> bool:
    return isinstance(v, dict) and bool(v) and all(isinstance(t, torch.Tensor) for t in v.values())


def split_state(tree: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict | None, int | None, dict[str, Any]]:
    """(model state, optimizer state dict or None, step, other top-level entries) of a DCP state dict."""
    if _is_model(tree):
        return tree, None, None, {}
    opt_keys = [k for k, v in tree.items() if _is_optimizer(v)]
    model_keys = [k for k, v in tree.items() if _is_model(v) and k not in opt_keys]
    if "model" in model_keys:
        model_keys = ["model"]
    if len(model_keys) != 1 or len(opt_keys) > 1:
        raise IncompatibleStateError(
            f"cannot tell the model in this DCP state dict: top-level entries {sorted(tree)}; expected one "
            "dict of tensors (e.g. 'model') and at most one optimizer state dict (with 'state' and 'param_groups')")
    step = tree.get("step")
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = int(step.item())
    step = step if isinstance(step, int) and not isinstance(step, bool) else None
    rest = {k: v for k, v in tree.items() if k not in model_keys + opt_keys and not (k == "step" and step is not None)}
    return tree[model_keys[0]], (tree[opt_keys[0]] if opt_keys else None), step, rest


def optimizer_class(osd: dict, name: str | None) -> type[torch.optim.Optimizer]:
    """``name`` (a class of torch.optim, e.g. "AdamW"), or the class the state's keys show."""
    if name:
        cls = getattr(torch.optim, name.rsplit(".", 1)[-1], None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise IncompatibleStateError(f"--optimizer {name!r}: expected a class of torch.optim, e.g. 'AdamW'")
        return cls
    keys = {k for st in osd["state"].values() if isinstance(st, dict) for k in st}
    groups = [g for g in osd["param_groups"] if isinstance(g, dict)]
    if {"exp_avg", "exp_avg_sq"} <= keys:
        return torch.optim.AdamW if any(g.get("decoupled_weight_decay") for g in groups) else torch.optim.Adam
    if "momentum_buffer" in keys or any("nesterov" in g for g in groups):
        return torch.optim.SGD
    raise IncompatibleStateError(f"cannot tell the optimizer class from its state keys {sorted(keys)}: name it "
                                 "(from_dcp(optimizer='AdamW'), python -m ckpt convert --optimizer AdamW)")


class _Model(torch.nn.Module):
    """A module whose state dict has exactly the given names: parameters (the optimizer's) and buffers."""

    def __init__(self, tensors: "OrderedDict[str, torch.Tensor]", params: set[str]) -> None:
        super().__init__()
        for name, t in tensors.items():
            *path, leaf = name.split(".")
            mod: torch.nn.Module = self
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, torch.nn.Module())
                mod = mod._modules[part]
            if name in params:
                mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=t.is_floating_point()))
            else:
                mod.register_buffer(leaf, t)


def build(tree: dict[str, Any], optimizer: str | None = None
          ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None, int | None, dict[str, Any]]:
    """A model (and optimizer) holding the DCP state dict ``tree``, its step and other entries."""
    msd, osd, step, rest = split_state(tree)
    names = set(msd)
    pnames: list[str] = []
    if osd is not None:
        for gi, g in enumerate(osd["param_groups"]):
            ps = g.get("params") if isinstance(g, dict) else None
            if not isinstance(ps, list) or not all(isinstance(p, str) for p in ps):
                raise IncompatibleStateError(
                    f"optimizer param group {gi}: expected parameter names (as get_state_dict saves them), got "
                    f"{ps!r}; save with torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)")
            missing = [p for p in ps if p not in names]
            if missing:
                raise IncompatibleStateError(f"optimizer param group {gi} names parameters the model state lacks: "
                                             f"{missing}")
            pnames += ps
    model = _Model(OrderedDict((k, v.detach().clone()) for k, v in msd.items()), set(pnames))
    if osd is None:
        return model, None, step, rest
    cls = optimizer_class(osd, optimizer)
    params = dict(model.named_parameters())
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[p] for p in g["params"]]}
              for g in osd["param_groups"]]
    opt = cls(groups)
    pos = {p: i for i, p in enumerate(pnames)}
    unknown = [k for k in osd["state"] if k not in pos]
    if unknown:
        raise IncompatibleStateError(f"optimizer state for parameters in no param group: {unknown[:8]}")
    opt.load_state_dict({
        "state": {pos[k]: dict(v) for k, v in osd["state"].items()},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [pos[p] for p in g["params"]]}
                         for g in osd["param_groups"]]})
    return model, opt, step, rest


def from_dcp(dcp_dir: str | os.PathLike, path: str | os.PathLike, comm: Any = None, optimizer: str | None = None,
             overwrite: bool = False) -> Manifest:
    """Convert the torch DCP checkpoint in ``dcp_dir`` into our checkpoint at ``path``.

    Collective over ``comm`` (None: mpicomm's world): every rank reads the DCP checkpoint and
    the ranks share the write (``ckpt.save``). The model state and a plain torch optimizer's
    state (its class named by ``optimizer``, else told from the state: Adam, AdamW or SGD) load
    with ``ckpt.load(path, model=, optimizer=)`` at any world size; ``step`` becomes the
    checkpoint's step and the other top-level entries its state items."""
    comm = mpicomm.as_communicator(comm)
    run = Collective(comm, "from_dcp")
    tree = run.everywhere("reading the DCP checkpoint", lambda: read_dcp(dcp_dir))
    model, opt, step, rest = run.everywhere("building", lambda: build(tree, optimizer))
    extra = {"imported_from": "torch-dcp", "source": os.path.abspath(os.fspath(dcp_dir))}
    return save(path, model=model, optimizer=opt, step=step, comm=comm, extra=extra, state=rest or None,
                overwrite=overwrite)
