"""Collective save and load of model and (sharded or plain) optimizer state."""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch

from . import checksum, commit, plan, safetensors_header
from .io import DEFAULT_CHUNK_BYTES, fsync_path, read_blocks, read_items, write_items
from .manifest import (DATA_NAME, DEFAULT_BLOCK_SIZE, INCOMPLETE_NAME, LATEST_NAME, MANIFEST_NAME, TMP_MARK,
                       DamagedCheckpointError, IncompleteCheckpointError, Manifest, ManifestError, Packer,
                       ParamInfo, jsonable, like)
from .zero import ZeroOptimizer

T = TypeVar("T")


class ChecksumError(RuntimeError):
    """Bytes read from a checkpoint do not match the checksums in its manifest."""


class CollectiveError(RuntimeError):
    """Another rank failed during a collective save or load (this rank's part went well)."""


class StateMismatchError(KeyError, ValueError):
    """The model's state names or shapes differ from the checkpoint's (``load(strict=True)``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass
class LoadResult:
    """What ``load`` found: the saved step and extras, and how the checkpoint was written.

    ``missing`` (model entries the checkpoint lacks), ``unexpected`` (checkpoint entries the
    model lacks) and ``mismatched`` (name -> (model shape, checkpoint shape)) list what a
    ``strict=False`` load left untouched; all empty after a strict load."""

    step: int | None
    extra: Any
    world_size: int
    stage: int | None
    optimizer_loaded: bool
    manifest: Manifest
    path: str = ""
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """True when every model entry was loaded and the checkpoint held nothing else."""
        return not (self.missing or self.unexpected or self.mismatched)


_DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16",
                torch.bfloat16: "bfloat16", torch.int64: "int64", torch.int32: "int32",
                torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name for a torch dtype."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"expected a dtype in {sorted(_DTYPES)}, got {dtype}") from None


def _comm(comm: Any) -> Any:
    """An mpicomm Communicator: the world one for None; an mpi4py communicator is wrapped."""
    import mpicomm
    from mpi4py import MPI

    if comm is None:
        return mpicomm.init()
    if isinstance(comm, MPI.Comm):
        return mpicomm.Communicator(comm)
    return comm


def _on_root(mpi_comm: Any, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 and broadcast its result; an exception is raised on every rank."""
    result: tuple[bool, Any] = (True, None)
    if mpi_comm.Get_rank() == 0:
        try:
            result = (True, fn())
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            result = (False, exc)
    ok, value = mpi_comm.bcast(result, root=0)
    if not ok:
        raise value
    return value


def _everywhere(mpi_comm: Any, fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` on every rank; if it raises on any rank, raise on every rank (the failing
    ranks their own exception, the others a CollectiveError naming it) instead of leaving the
    others waiting in the next collective call."""
    err: BaseException | None = None
    value: Any = None
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
        err = exc
    if mpi_comm.Get_size() > 1:
        msgs = mpi_comm.allgather(None if err is None else f"{type(err).__name__}: {err}")
    else:
        msgs = [None]
    if err is not None:
        raise err
    bad = [(r, m) for r, m in enumerate(msgs) if m is not None]
    if bad:
        lines = "; ".join(f"rank {r}: {m}" for r, m in bad[:8])
        raise CollectiveError(f"{what} failed on {len(bad)} of {len(msgs)} rank(s): {lines}")
    return value


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _model_state(model: torch.nn.Module) -> tuple[list[str], list[torch.Tensor], dict[str, str], set[str]]:
    """Names and tensors of the model's state, aliases (tied tensors) and buffer names."""
    sd = model.state_dict(keep_vars=True)
    names, tensors, aliases = [], [], {}
    first: dict[int, str] = {}
    for name, t in sd.items():
        key = id(t)
        if key in first:
            aliases[name] = first[key]
            continue
        first[key] = name
        names.append(name)
        tensors.append(t)
    buffers = {n for n, _ in model.named_buffers()}
    return names, tensors, aliases, buffers


def _opt_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _scalar(value: Any, what: str) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"value": value.item(), "dtype": dtype_name(value.dtype)}
    if isinstance(value, (bool, int, float)) or value is None:
        return {"value": value, "dtype": None}
    raise TypeError(f"{what}: expected a tensor or a number, got {type(value).__name__}")


def _unscalar(d: dict[str, Any], device: torch.device) -> Any:
    if d.get("dtype") is None:
        return d["value"]
    return torch.tensor(d["value"], dtype=_DTYPES[d["dtype"]])


def _split_state(state: dict[str, Any], shape: torch.Size, what: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Per-element tensors (shaped like ``shape``) and scalars of one parameter's state."""
    tensors, scalars = {}, {}
    for key, v in state.items():
        if isinstance(v, torch.Tensor) and v.shape == shape and not (v.dim() == 0 and key == "step"):
            tensors[key] = v
        elif isinstance(v, torch.Tensor) and v.dim() > 0:
            raise ValueError(f"{what}: state {key!r} has shape {tuple(v.shape)}; expected the parameter's "
                             f"shape {tuple(shape)} or a scalar")
        else:
            scalars[key] = _scalar(v, f"{what}: state {key!r}")
    return tensors, scalars


def _groups_json(optimizer: torch.optim.Optimizer, index: dict[int, int]) -> list[dict[str, Any]]:
    out = []
    for gi, g in enumerate(optimizer.param_groups):
        d = {k: jsonable(v, f"param_groups[{gi}].{k}") for k, v in g.items() if k != "params"}
        d["params"] = [index[id(p)] for p in g["params"]]
        out.append(d)
    return out


# ---------------------------------------------------------------------------------------------
# save


def save(path: str | os.PathLike, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         step: int | None = None, comm: Any = None, extra: Any = None, sync: bool = True,
         overwrite: bool = False, update_latest: bool = True, block_size: int = DEFAULT_BLOCK_SIZE,
         chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Manifest:
    """Save model weights, optimizer state, step and JSON-able ``extra`` to directory ``path``.

    Collective over ``comm`` (default: the ZeroOptimizer's communicator, else the world).
    Every rank writes its own shard (and an even share of replicated tensors) into one data
    file with MPI-IO, in a working directory ``.<name>.tmp-<id>`` marked ``INCOMPLETE``; rank 0
    then writes the manifest, drops the marker, and publishes the directory under its final
    name by an atomic rename (an atomic swap with ``overwrite``), holding a lock on the parent so
    that concurrent saves commit one at a time; ``<parent>/latest`` then names it. A failure on
    any rank raises on every rank. ``sync`` makes the data and manifest durable (fsync) first.
    """
    if comm is None and isinstance(optimizer, ZeroOptimizer):
        comm = optimizer.comm
    comm = _comm(comm)
    mpi = comm.mpi_comm
    path = os.path.abspath(os.fspath(path))
    mine, buffers, manifest = _everywhere(
        mpi, lambda: _plan_save(mpi, model, optimizer, step, extra, block_size, chunk_bytes), "save (planning)")
    size = manifest.world_size

    def prepare() -> str:
        if os.path.exists(path) and not overwrite:
            raise FileExistsError(f"save: {path} exists (pass overwrite=True to replace it)")
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(path)}{TMP_MARK}{uuid.uuid4().hex[:12]}")
        os.mkdir(tmp)
        with open(os.path.join(tmp, INCOMPLETE_NAME), "w") as f:
            f.write(json.dumps({"target": path, "world_size": size, "host": socket.gethostname(),
                                "pid": os.getpid(), "started": time.time()}) + "\n")
        return tmp

    tmp = _on_root(mpi, prepare)
    pieces = _everywhere(mpi, lambda: write_items(
        mpi, os.path.join(tmp, DATA_NAME), mine, buffers, file_size=manifest.files[DATA_NAME]["nbytes"],
        block_size=block_size, chunk_bytes=chunk_bytes, sync=sync), "save (writing data)")
    gathered = mpi.gather([(p.offset, p.length, p.crc) for p in pieces], root=0)

    def finish() -> Manifest:
        allp = [checksum.Piece(*t) for lst in gathered for t in lst]
        manifest.files[DATA_NAME]["crc32"] = checksum.combine_blocks(allp, manifest.files[DATA_NAME]["nbytes"],
                                                                     block_size)
        manifest.validate()
        mpath = os.path.join(tmp, MANIFEST_NAME)
        with open(mpath, "w") as f:
            f.write(manifest.to_json())
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.unlink(os.path.join(tmp, INCOMPLETE_NAME))  # the manifest is durable: the save is complete
        if sync:
            fsync_path(tmp, directory=True)
        parent = os.path.dirname(path)
        with commit.dir_lock(parent):
            try:
                old = commit.publish(tmp, path, overwrite)
            except FileExistsError:
                shutil.rmtree(tmp, ignore_errors=True)  # complete but never published: ours to remove
                raise
            if sync:
                fsync_path(parent, directory=True)
            if update_latest:
                _write_latest(parent, os.path.basename(path), sync)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return manifest

    return _on_root(mpi, finish)


def _plan_save(mpi: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step: int | None,
               extra: Any, block_size: int, chunk_bytes: int
               ) -> tuple[list[plan.IOItem], list[torch.Tensor], Manifest]:
    """This rank's write items and buffers, and the manifest (checksums still empty)."""
    rank, size = mpi.Get_rank(), mpi.Get_size()
    if chunk_bytes % block_size:
        raise ValueError(f"expected chunk_bytes a multiple of block_size={block_size}, got {chunk_bytes}")

    names, tensors, aliases, buffer_names = _model_state(model)
    index = {id(t): i for i, t in enumerate(tensors)}
    params = [ParamInfo(n, tuple(t.shape), dtype_name(t.dtype), n in buffer_names)
              for n, t in zip(names, tensors)]
    packer = Packer(DATA_NAME)
    buffers: list[torch.Tensor] = []
    replicated: list[plan.IOItem] = []
    sharded: list[plan.IOItem] = []

    def add_buffer(t: torch.Tensor) -> int:
        buffers.append(t.detach() if t.is_contiguous() else t.detach().contiguous())
        return len(buffers) - 1

    zero = optimizer if isinstance(optimizer, ZeroOptimizer) else None
    if zero is not None and zero.comm.size != size:
        raise ValueError(f"save: the optimizer shards over {zero.comm.size} ranks but comm has {size}")
    opt_ids = {id(p) for p in _opt_params(optimizer)} if optimizer is not None else set()
    for p in _opt_params(optimizer) if optimizer is not None else []:
        if id(p) not in index:
            raise ValueError("save: the optimizer holds a parameter that is not in model.state_dict()")

    # model weights (fp32 weights under a ZeroOptimizer are the masters' bytes: added below)
    for i, (n, t) in enumerate(zip(names, tensors)):
        if zero is not None and id(t) in opt_ids and t.dtype == torch.float32:
            continue
        e = packer.add(n, i, "param", t.shape, dtype_name(t.dtype))
        replicated.append(plan.IOItem(e.offset, e.nbytes, add_buffer(t), 0))

    opt_meta: dict[str, Any] | None = None
    if zero is not None:
        opt_meta, items = _plan_zero_save(zero, index, names, tensors, packer, add_buffer)
        sharded.extend(items)
    elif optimizer is not None:
        opt_meta, items = _plan_plain_save(optimizer, index, names, tensors, packer, add_buffer)
        replicated.extend(items)

    # data.bin is a safetensors file: its header goes in front of the tensors (written by whoever's share it is)
    head = safetensors_header.seal(packer, {"format": "pt"})
    replicated = [plan.IOItem(0, len(head), add_buffer(torch.frombuffer(bytearray(head), dtype=torch.uint8)), 0)]\
        + plan.shift(replicated, len(head))
    sharded = plan.shift(sharded, len(head))
    mine = plan.share_items(sorted(replicated, key=lambda it: it.offset), size, rank, block_size) + sharded
    manifest = Manifest(world_size=size, stage=zero.stage if zero is not None else None,
                        step=step, params=params, tensors=packer.entries,
                        files={DATA_NAME: {"nbytes": packer.size, "crc32": []}},
                        optimizer=opt_meta, extra=jsonable(extra, "extra"), block_size=block_size,
                        info={"torch": torch.__version__, "aliases": aliases})
    return mine, buffers, manifest


def _write_latest(parent: str, name: str, sync: bool) -> None:
    tmp = os.path.join(parent, f".{LATEST_NAME}.tmp-{uuid.uuid4().hex[:12]}")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, os.path.join(parent, LATEST_NAME))
    if sync:
        fsync_path(parent, directory=True)


def _plan_zero_save(zero: ZeroOptimizer, index: dict[int, int], names: list[str],
                    tensors: list[torch.Tensor], packer: Packer,
                    add_buffer: Callable[[torch.Tensor], int]) -> tuple[dict[str, Any], list[plan.IOItem]]:
    rank = zero.rank
    items: list[plan.IOItem] = []
    # the set of state keys (per-element tensors) and scalars of each group's shard
    group_tensors: list[dict[str, torch.Tensor]] = []
    scalars: dict[str, dict[str, Any]] = {}
    for gi, g in enumerate(zero.groups):
        t_keys, s_keys = _split_state(zero.shard_state(gi), g.master.shape, f"param group {gi}")
        group_tensors.append(t_keys)
        for p in g.params:
            scalars[str(index[id(p)])] = s_keys
    # masters
    for g in zero.groups:
        entries = {}
        for li, p in enumerate(g.params):
            i = index[id(p)]
            entries[li] = e = packer.add(names[i], i, "master", p.shape, "float32")
            if p.dtype == torch.float32:
                packer.alias(e, "param")
        items += plan.shard_items(g.layout.segments(rank), entries, add_buffer(g.master))
    # optimizer state, key by key
    keys: list[str] = []
    for t_keys in group_tensors:
        keys += [k for k in t_keys if k not in keys]
    for key in keys:
        for gi, g in enumerate(zero.groups):
            t = group_tensors[gi].get(key)
            if t is None:
                continue
            entries = {}
            for li, p in enumerate(g.params):
                i = index[id(p)]
                entries[li] = packer.add(names[i], i, "state", p.shape, dtype_name(t.dtype), key)
            items += plan.shard_items(g.layout.segments(rank), entries, add_buffer(t))
    meta = {"class": _class_name(zero.optimizer_class), "param_groups": _groups_json(zero, index),
            "scalars": scalars}
    return meta, items


def _plan_plain_save(optimizer: torch.optim.Optimizer, index: dict[int, int], names: list[str],
                     tensors: list[torch.Tensor], packer: Packer,
                     add_buffer: Callable[[torch.Tensor], int]) -> tuple[dict[str, Any], list[plan.IOItem]]:
    items: list[plan.IOItem] = []
    per_param: list[tuple[int, dict[str, torch.Tensor]]] = []
    scalars: dict[str, dict[str, Any]] = {}
    keys: list[str] = []
    for p in _opt_params(optimizer):
        i = index[id(p)]
        t_keys, s_keys = _split_state(optimizer.state.get(p, {}), p.shape, f"parameter {names[i]!r}")
        per_param.append((i, t_keys))
        if s_keys:
            scalars[str(i)] = s_keys
        keys += [k for k in t_keys if k not in keys]
    for key in keys:
        for i, t_keys in per_param:
            t = t_keys.get(key)
            if t is not None:
                e = packer.add(names[i], i, "state", t.shape, dtype_name(t.dtype), key)
                items.append(plan.IOItem(e.offset, e.nbytes, add_buffer(t), 0))
    meta = {"class": _class_name(type(optimizer)), "param_groups": _groups_json(optimizer, index),
            "scalars": scalars}
    return meta, items


# ---------------------------------------------------------------------------------------------
# load


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
    if os.path.isfile(latest):
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
    raise ManifestError(f"no checkpoint at {path}: expected {MANIFEST_NAME} or a {LATEST_NAME} pointer")


MAX_MANIFEST_BYTES = 1 << 30


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Read and check the manifest of the checkpoint at ``path`` (no MPI): it must parse, be
    of a format version this code reads, and describe a data file of the size found."""
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
        raise ManifestError(f"{mpath}: {exc}") from None
    dpath = os.path.join(d, DATA_NAME)
    want = int(m.files[DATA_NAME]["nbytes"])
    if not os.path.isfile(dpath):
        raise DamagedCheckpointError(f"{d}: {DATA_NAME} is missing (the manifest expects {want} bytes)")
    size = os.path.getsize(dpath)
    if size != want:
        raise DamagedCheckpointError(f"{dpath}: expected {want} bytes, found {size} "
                                     f"({'truncated' if size < want else 'longer than written'})")
    return m


class _Reads:
    """Destinations and file dtypes of one rank's reads."""

    def __init__(self) -> None:
        self.items: list[plan.IOItem] = []
        self.dests: list[torch.Tensor] = []
        self.dtypes: list[torch.dtype] = []

    def add(self, dest: torch.Tensor, dtype: str) -> int:
        self.dests.append(dest)
        self.dtypes.append(_DTYPES[dtype])
        return len(self.dests) - 1


def load(path: str | os.PathLike, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         comm: Any = None, strict: bool = True, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> LoadResult:
    """Load a checkpoint saved by ``save`` at any world size and stage into ``model`` and
    (optionally) ``optimizer``: a ZeroOptimizer of any stage on ``comm``, or a plain torch
    optimizer (full state on every rank). Collective. Each rank reads only the bytes it keeps
    and checks them against the block checksums; on an error the model and optimizer are left
    in an undefined state.

    ``strict`` (default): the model's state names and shapes must equal the checkpoint's, else
    a StateMismatchError lists every difference. ``strict=False`` loads the entries whose name
    and shape match and reports the rest in the result (``missing``, ``unexpected``,
    ``mismatched``); an optimizer is then loaded only if all its parameters match."""
    if comm is None and isinstance(optimizer, ZeroOptimizer):
        comm = optimizer.comm
    comm = _comm(comm)
    mpi = comm.mpi_comm
    text_dir = _on_root(mpi, lambda: (read_manifest(path).to_json(), resolve(path)))
    m = Manifest.from_json(text_dir[0])
    ckdir = text_dir[1]
    block = m.block_size
    reads = _Reads()
    post: list[Callable[[], None]] = []
    report: dict[str, Any] = {}

    def plan_reads() -> bool:
        midx = m.param_index()
        names, tensors, _aliases, _bufs = _model_state(model)
        name_set = set(names)
        missing = [n for n in names if n not in midx]
        unexpected = [p.name for p in m.params if p.name not in name_set]
        mismatched = {n: (tuple(t.shape), tuple(m.params[midx[n]].shape)) for n, t in zip(names, tensors)
                      if n in midx and tuple(m.params[midx[n]].shape) != tuple(t.shape)}
        report.update(missing=missing, unexpected=unexpected, mismatched=mismatched)
        if strict and (missing or unexpected or mismatched):
            raise StateMismatchError(_mismatch_message(ckdir, missing, unexpected, mismatched))
        by_id = {id(t): midx[n] for n, t in zip(names, tensors) if n in midx and n not in mismatched}

        if optimizer is not None and any(id(p) not in by_id for p in _opt_params(optimizer)):
            if strict or not (missing or mismatched):
                raise ValueError("load: the optimizer holds parameters that are not in model.state_dict()")
            raise StateMismatchError(
                "load(strict=False): the optimizer holds parameters that the checkpoint lacks or holds in "
                "another shape, and optimizer state cannot be loaded in part: "
                + _mismatch_message(ckdir, missing, [], mismatched, hint=False)
                + "; pass optimizer=None to load the matching model entries alone")
        zero = optimizer if isinstance(optimizer, ZeroOptimizer) else None
        if zero is not None and zero.comm.size != mpi.Get_size():
            raise ValueError(f"load: the optimizer shards over {zero.comm.size} ranks but comm has {mpi.Get_size()}")
        has_opt = optimizer is not None and m.optimizer is not None
        if has_opt:
            want, got = m.optimizer["class"], _class_name(zero.optimizer_class if zero else type(optimizer))
            if want != got:
                raise TypeError(f"load: checkpoint holds {want} state, the optimizer is {got}")

        # model weights: read whole, except those a ZeroOptimizer gathers from its masters
        from_masters = {id(p) for p in _opt_params(zero)} if zero is not None else set()
        for n, t in zip(names, tensors):
            if id(t) not in by_id or id(t) in from_masters:
                continue
            # fp32 weights come from the fp32 masters when the checkpoint has them
            e = (m.find("master", midx[n]) if t.dtype == torch.float32 else None) or m.find("param", midx[n])
            if e is None:
                raise ManifestError(f"load: checkpoint has no weights for {n!r}")
            dest = t.detach()
            if not dest.is_contiguous():
                tmp = torch.empty(dest.shape, dtype=dest.dtype, device=dest.device)
                post.append(lambda d=dest, s=tmp: d.copy_(s))
                dest = tmp
            reads.items.append(plan.IOItem(e.offset, e.nbytes, reads.add(dest.view(-1), e.dtype), 0))

        if zero is not None:
            post.append(_plan_zero_load(zero, m, by_id, reads, has_opt))
        elif has_opt:
            post.append(_plan_plain_load(optimizer, m, by_id, reads))
        return has_opt

    has_opt = _everywhere(mpi, plan_reads, "load (planning)")
    pieces = _everywhere(mpi, lambda: read_items(mpi, os.path.join(ckdir, DATA_NAME), reads.items, reads.dests,
                                                 reads.dtypes, block_size=block, chunk_bytes=chunk_bytes),
                         "load (reading data)")
    gathered = mpi.gather([(p.offset, p.length, p.crc) for p in pieces], root=0)

    def verify() -> None:
        f = m.files[DATA_NAME]
        expected, fsize = f["crc32"], int(f["nbytes"])
        allp = [checksum.Piece(*t) for lst in gathered for t in lst]
        bad, partial = checksum.verify_blocks(allp, expected, fsize, block)
        if partial:
            crcs = read_blocks(os.path.join(ckdir, DATA_NAME), partial, block, fsize)
            bad += [b for b, c in zip(partial, crcs) if c != expected[b]]
        if bad:
            raise ChecksumError(f"load: {ckdir}/{DATA_NAME}: checksum mismatch in {len(bad)} "
                                f"block(s) of {block} bytes: {m.describe_blocks(bad)}")

    _on_root(mpi, verify)

    def apply() -> None:
        for fn in post:
            fn()

    _everywhere(mpi, apply, "load (setting state)")
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.gather_params()  # collective: the model weights from every rank's masters
    return LoadResult(step=m.step, extra=m.extra, world_size=m.world_size, stage=m.stage,
                      optimizer_loaded=has_opt, manifest=m, path=ckdir, **report)


def _mismatch_message(ckdir: str, missing: list[str], unexpected: list[str],
                      mismatched: dict[str, tuple[tuple[int, ...], tuple[int, ...]]], hint: bool = True) -> str:
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint ({len(missing)}): {missing}")
    if unexpected:
        parts.append(f"unexpected, in the checkpoint but not the model ({len(unexpected)}): {unexpected}")
    if mismatched:
        parts.append(f"other shapes ({len(mismatched)}): " + ", ".join(
            f"{n!r} expected shape {a}, checkpoint has {b}" for n, (a, b) in mismatched.items()))
    counts = f"(missing {len(missing)}, unexpected {len(unexpected)}, other shapes {len(mismatched)})"
    head = f"load: model state does not match the checkpoint {ckdir} {counts}: " if hint else ""
    return head + "; ".join(parts) + ("; pass strict=False to load the matching part" if hint else "")


def _check_groups(optimizer: torch.optim.Optimizer, m: Manifest, by_id: dict[int, int]) -> None:
    saved = m.optimizer["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"load: expected {len(optimizer.param_groups)} param groups, "
                         f"checkpoint has {len(saved)}")
    for gi, (g, s) in enumerate(zip(optimizer.param_groups, saved)):
        mine = [by_id.get(id(p)) for p in g["params"]]
        if mine != list(s["params"]):
            raise ValueError(f"load: param group {gi} holds parameters {mine}, "
                             f"checkpoint group has {s['params']}")


def _set_hyperparams(optimizer: torch.optim.Optimizer, m: Manifest) -> None:
    for g, s in zip(optimizer.param_groups, m.optimizer["param_groups"]):
        for k, v in s.items():
            if k != "params":
                g[k] = like(g.get(k), v)


def _zero_padding(t: torch.Tensor, segments) -> None:
    """Zero the elements of a local shard that no segment covers."""
    pos = 0
    for s in sorted(segments, key=lambda s: s.local):
        if s.local > pos:
            t[pos:s.local].zero_()
        pos = s.local + s.length
    if pos < t.numel():
        t[pos:].zero_()


def _plan_zero_load(zero: ZeroOptimizer, m: Manifest, by_id: dict[int, int], reads: _Reads,
                    has_opt: bool) -> Callable[[], None]:
    rank = zero.rank
    if has_opt:
        _check_groups(zero, m, by_id)
    states: list[dict[str, Any]] = []
    keys = m.state_keys() if has_opt else []
    for gi, g in enumerate(zero.groups):
        ids = [by_id[id(p)] for p in g.params]
        segs = g.layout.segments(rank)
        _zero_padding(g.master, segs)
        src = {}
        for li, i in enumerate(ids):
            e = m.find("master", i) or m.find("param", i)
            if e is None:
                raise ManifestError(f"load: checkpoint has no weights for {m.params[i].name!r}")
            src[li] = e
        dtypes = {e.dtype for e in src.values()}
        for dt in dtypes:
            buf = reads.add(g.master, dt)
            reads.items += plan.shard_items(segs, {li: e for li, e in src.items() if e.dtype == dt}, buf)
        state: dict[str, Any] = {}
        for key in keys:
            ents = {li: m.find("state", i, key) for li, i in enumerate(ids)}
            present = {li: e for li, e in ents.items() if e is not None}
            if not present:
                continue
            if len(present) != len(ids):
                raise ManifestError(f"load: state {key!r} is saved for some parameters of group {gi} only")
            dt = next(iter(present.values())).dtype
            # floating state lives in fp32 beside the fp32 masters, whatever dtype it was saved in
            kind = _DTYPES[dt]
            t = torch.empty(g.layout.local_numel, dtype=torch.float32 if kind.is_floating_point else kind,
                            device=g.master.device)
            _zero_padding(t, segs)
            state[key] = t
            reads.items += plan.shard_items(segs, present, reads.add(t, dt))
        if has_opt:
            sc = [m.optimizer["scalars"].get(str(i), {}) for i in ids]
            for key in sc[0] if sc else []:
                vals = {repr(s.get(key)) for s in sc}
                if len(vals) != 1:
                    raise ValueError(f"load: group {gi} parameters have different {key!r}: {sorted(vals)}; "
                                     "a ZeroOptimizer group needs one value")
                state[key] = _unscalar(sc[0][key], g.master.device)
        states.append(state)

    def finish() -> None:
        if has_opt:
            _set_hyperparams(zero, m)
        for gi, st in enumerate(states):
            zero.set_shard_state(gi, st)

    return finish


def _plan_plain_load(optimizer: torch.optim.Optimizer, m: Manifest, by_id: dict[int, int],
                     reads: _Reads) -> Callable[[], None]:
    _check_groups(optimizer, m, by_id)
    keys = m.state_keys()
    params = _opt_params(optimizer)
    state: dict[int, dict[str, Any]] = {}
    for pos, p in enumerate(params):
        i = by_id[id(p)]
        st: dict[str, Any] = {}
        for key in keys:
            e = m.find("state", i, key)
            if e is None:
                continue
            t = torch.empty(e.shape, dtype=_DTYPES[e.dtype])
            st[key] = t
            reads.items.append(plan.IOItem(e.offset, e.nbytes, reads.add(t.view(-1), e.dtype), 0))
        for key, d in m.optimizer["scalars"].get(str(i), {}).items():
            st[key] = _unscalar(d, p.device)
        if st:
            state[pos] = st

    position = {id(p): pos for pos, p in enumerate(params)}

    def finish() -> None:
        groups = []
        for g, s in zip(optimizer.param_groups, m.optimizer["param_groups"]):
            d = {k: like(g.get(k), v) for k, v in s.items() if k != "params"}
            d["params"] = [position[id(p)] for p in g["params"]]
            groups.append(d)
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    return finish
