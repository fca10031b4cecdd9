"""``save`` and ``load``: the collective steps, top to bottom (planning in ``model_state``,
``optimizers`` and ``items``, files in ``storage``, bytes in ``io``, failures on every rank
through ``collective``)."""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

import mpicomm

from . import async_save as async_save_mod
from . import checksum, dtensor, items, safetensors_header
from .async_save import SaveHandle
from .collective import Collective
from .errors import IncompatibleStateError, StateMismatchError
from .io import DEFAULT_CHUNK_BYTES, read_items, write_items
from .io_plan import ReadPlan, SavePlan
from .manifest import DATA_NAME, DEFAULT_BLOCK_SIZE, Manifest, jsonable
from .model_state import Match, ModelState, plan_model_load, plan_model_save
from .optimizers import OptimizerPlanner, planner_for
from .stateful import is_per_rank, is_stateful, restore, split_item
from .storage import commit_save, create_workdir, read_manifest_text, resolve, verify_data


def _communicator(comm: Any, opt: OptimizerPlanner | None) -> mpicomm.Communicator:
    """``comm``; when None, the optimizer's own communicator, else the world."""
    own = opt.communicator() if comm is None and opt is not None else None
    return own if own is not None else mpicomm.as_communicator(comm)


@dataclass
class LoadResult:
    """What ``load`` found: the saved step and extras, and how the checkpoint was written.

    ``missing`` (model entries the checkpoint lacks), ``unexpected`` (checkpoint entries the
    model lacks) and ``mismatched`` (name -> (model shape, checkpoint shape)) list what a
    ``strict=False`` load left untouched; all empty after a strict load. ``state`` maps each
    name of ``load(state=...)`` to the object loaded in place, or to the saved value where
    there was nothing to load into (a number, a string)."""

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
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """True when every model entry was loaded and the checkpoint held nothing else."""
        return not (self.missing or self.unexpected or self.mismatched)


def save(path: str | os.PathLike, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         step: int | None = None, comm: Any = None, extra: Any = None, state: dict[str, Any] | None = None,
         sync: bool = True, overwrite: bool = False, update_latest: bool = True,
         block_size: int = DEFAULT_BLOCK_SIZE, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
         async_save: bool = False, snapshot: str = "now") -> Manifest | SaveHandle:
    """Save model weights, optimizer state, step, JSON-able ``extra`` and the ``state`` items
    (name -> object with state_dict(), tensor, or data nested in dicts/lists; ``ckpt.RNG()``,
    ``ckpt.PerRank(obj)`` and objects with ``per_rank_state_dict()`` per rank) to ``path``.

    Collective over ``comm`` (default: the ZeroOptimizer's communicator, else the world).
    Every rank writes its own shard (and an even share of replicated tensors) into one data
    file (each rank on its own with O_DIRECT or POSIX calls, or collective MPI-IO: ``ckpt.io``;
    never MPI-IO under ULFM), in a working directory ``.<name>.tmp-<id>`` marked ``INCOMPLETE``; rank 0
    then writes the manifest, drops the marker, and publishes the directory under its final
    name by an atomic rename (an atomic swap with ``overwrite``), holding a lock on the parent so
    that concurrent saves commit one at a time; ``<parent>/latest`` then names it. A failure on
    any rank raises the same exception on every rank. ``sync`` makes the data and manifest
    durable (fsync) first.

    ``async_save``: return a ``SaveHandle`` as soon as every rank has copied what it writes
    into host memory it owns (reused across saves); the writing, checksums and commit run in a
    background thread on a duplicate of ``comm`` (needs MPI_THREAD_MULTIPLE), and ``latest``
    moves at the commit. ``handle.wait()`` returns the manifest; a failure is raised on every
    rank at the next ``wait()``, ``save``, ``load`` or ``ckpt.wait_pending()``. A save waits for
    the one in flight on the same communicator first.

    ``snapshot='background'`` (with ``async_save`` and a torch optimizer): the parameters and
    optimizer state are copied by the background thread too, so ``save`` returns after planning;
    ``optimizer.step()`` waits for that copy (``handle.wait_snapshot()`` does too). Until then,
    change them only through that step: a change the save sees (a tensor's version counter
    moved) fails the save on every rank, but one made through ``.data`` is not seen.
    """
    if snapshot not in ("now", "background"):
        raise ValueError(f"save: expected snapshot='now' or 'background', got {snapshot!r}")
    if snapshot == "background" and not (async_save and isinstance(optimizer, torch.optim.Optimizer)):
        raise ValueError("save: snapshot='background' needs async_save=True and the torch optimizer that updates "
                         f"the model (its step() waits for the snapshot); got async_save={async_save}, optimizer of "
                         f"type {type(optimizer).__name__}")
    opt = planner_for(optimizer)
    comm = _communicator(comm, opt)
    async_save_mod.wait_pending(comm)  # one save in flight per communicator; raises a failed one's error
    run = Collective(comm, "save")
    path = os.path.abspath(os.fspath(path))
    prepared = None
    if opt is not None:
        prepared = run.everywhere("gathering the optimizer state", lambda: opt.prepare_save(comm.size))
    sp, manifest, captured, summary = run.everywhere("planning", lambda: _plan_save(
        comm, model, opt, prepared, step, extra, state or {}, block_size, chunk_bytes))
    summaries = run.allgather(summary)
    if len({s["@table"] for s in summaries}) > 1:  # the same answer on every rank
        tables = run.allgather(sp.table())
        run.everywhere("checking tensor shapes", lambda: dtensor.check_tables(tables, "save"))
    mine = run.everywhere("planning state items", lambda: _plan_writes(comm, manifest, sp, captured, summaries))

    def finish(c: mpicomm.Communicator, buffers: list[torch.Tensor], manifest: Manifest) -> Manifest:
        run = Collective(c, "save")
        tmp = run.on_root("creating the working directory", lambda: create_workdir(path, c.size, overwrite))
        nbytes = manifest.files[DATA_NAME]["nbytes"]
        parts, counts = run.everywhere("writing data", lambda: checksum.block_parts(write_items(
            c, os.path.join(tmp, DATA_NAME), mine, buffers, file_size=nbytes, block_size=block_size,
            chunk_bytes=chunk_bytes, sync=sync), nbytes, block_size))
        parts, counts = run.reduce_xor(parts), run.reduce_sum(counts)  # one fixed-size array each, at the root
        return run.on_root("committing", lambda: commit_save(
            tmp, path, manifest, checksum.blocks_from_parts(parts, counts, nbytes, block_size), overwrite=overwrite,
            sync=sync, update_latest=update_latest))

    if async_save:
        later = (async_save_mod.updated_by_step(sp.buffers, model, opt)
                 if snapshot == "background" and opt is not None else None)
        return async_save_mod.start(comm, run, sp.buffers, manifest, finish, later, optimizer)
    return finish(comm, sp.buffers, manifest)


def _plan_save(comm: mpicomm.Communicator, model: torch.nn.Module, opt: OptimizerPlanner | None, prepared: Any,
               step: int | None, extra: Any, state: dict[str, Any], block_size: int, chunk_bytes: int
               ) -> tuple[SavePlan, Manifest, dict[tuple[str, str], items.Captured], dict]:
    """What this rank writes of the model and optimizer (``prepared``: what the optimizer
    planner's ``prepare_save`` gave), the manifest (state items and checksums still to come),
    this rank's state items, captured, and their summary."""
    if chunk_bytes % block_size:
        raise ValueError(f"expected chunk_bytes a multiple of block_size={block_size}, got {chunk_bytes}")
    model_state = ModelState.of(model)
    index = model_state.index()
    sp = SavePlan()
    saved = None
    if opt is not None:
        opt.check_in_model(index)
    plan_model_save(model_state, sp, opt.saves_weights if opt is not None else None)
    if opt is not None:
        saved = opt.plan_save(prepared, model_state, index, sp, comm.rank)
    manifest = Manifest(world_size=comm.size, stage=opt.stage if opt is not None else None, step=step,
                        params=model_state.params(), tensors=sp.packer.entries, files={},
                        optimizer=saved.entry if saved is not None else None,
                        extra=jsonable(extra, "extra"), block_size=block_size,
                        info={"torch": torch.__version__, "aliases": model_state.aliases})
    captured = {("items", name): items.capture(*_parts(obj, f"state item {name!r}"))
                for name, obj in state.items()}
    if saved is not None:
        has_extra = saved.extra is not None
        per_rank = opt.per_rank_object()
        if has_extra or per_rank is not None:
            mine = per_rank.per_rank_state_dict() if per_rank is not None else None
            captured[("optimizer", "optimizer")] = items.capture(saved.extra, "optimizer state", has_extra,
                                                                 mine, per_rank is not None)
    summary: dict[Any, Any] = {key: c.summary() for key, c in captured.items()}
    summary["@pg"] = dtensor.pg_rank()
    summary["@table"] = zlib.crc32(json.dumps(sp.table()).encode())
    return sp, manifest, captured, summary


def _plan_writes(comm: mpicomm.Communicator, manifest: Manifest, sp: SavePlan,
                 captured: dict[tuple[str, str], items.Captured], summaries: list[dict]) -> list:
    """Given every rank's summary (in rank order): check the DTensor meshes, complete the manifest
    with the state items, and return what this rank writes."""
    dtensor.check_meshes(sp.sharded, [s["@pg"] for s in summaries], "save")
    _plan_items_save(comm, manifest, sp, captured, summaries)
    return sp.items(comm.rank, comm.size, manifest.block_size)


def _parts(obj: Any, what: str) -> tuple[Any, str, bool, Any, bool]:
    has_value, value, has_mine, mine = split_item(obj, what)
    return value, what, has_value, mine, has_mine


def _plan_items_save(comm: mpicomm.Communicator, manifest: Manifest, sp: SavePlan,
                     captured: dict[tuple[str, str], items.Captured], summaries: list[dict]) -> None:
    """Add the state items to this rank's writes and to the manifest, which is then complete."""
    section: dict[str, Any] = {"items": {}}
    for (space, name), c in captured.items():
        what = "optimizer state" if space == "optimizer" else f"state item {name!r}"
        entry = items.plan_save(what, f"{space}/{name}", c, [s[(space, name)] for s in summaries], comm.rank, sp)
        if space == "optimizer":
            section["optimizer"] = entry
        else:
            section["items"][name] = entry
    manifest.state = section
    safetensors_header.add_header(sp, {"format": "pt"})  # data.bin is a safetensors file
    manifest.tensors = sp.packer.entries
    manifest.files = {DATA_NAME: {"nbytes": sp.packer.size, "crc32": []}}


def load(path: str | os.PathLike, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         comm: Any = None, state: dict[str, Any] | None = None, strict: bool = True,
         chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> LoadResult:
    """Load a checkpoint saved by ``save`` at any world size and stage into ``model`` and
    (optionally) ``optimizer``: a ZeroOptimizer of any stage on ``comm``, or a plain torch
    optimizer (full state on every rank). Collective. Each rank reads only the bytes it keeps
    and checks them against the block checksums; on an error the model and optimizer are left
    in an undefined state, and every rank raises the same exception.

    ``strict`` (default): the model's state names and shapes must equal the checkpoint's, else
    a StateMismatchError lists every difference. ``strict=False`` loads the entries whose name
    and shape match and reports the rest in the result (``missing``, ``unexpected``,
    ``mismatched``); an optimizer is then loaded only if all its parameters match.

    ``state`` names the state items to load (as given to ``save``): objects take their state
    in place (``load_state_dict``; per-rank objects ``load_per_rank_state_dict``), tensors,
    dicts and lists are filled in place; ``LoadResult.state`` has every item."""
    opt = planner_for(optimizer)
    comm = _communicator(comm, opt)
    async_save_mod.wait_pending(comm)  # a save in flight commits (or raises its failure) first
    run = Collective(comm, "load")
    held: list[Manifest] = []  # rank 0's, parsed and checked once

    def read() -> tuple[str, str]:
        m, text = read_manifest_text(path)
        held.append(m)
        return text, resolve(path)

    text, ckdir = run.on_root("reading the manifest", read)
    m = held[0] if held else Manifest.from_json(text, checked=True)  # the bytes rank 0 checked
    chunk_bytes = max(m.block_size, chunk_bytes // m.block_size * m.block_size)  # rounds end on the saved blocks
    result: dict[str, Any] = {}
    pg_ranks = run.allgather(dtensor.pg_rank())
    rp, match, has_opt = run.everywhere("planning", lambda: _plan_load(
        comm, m, ckdir, model, opt, strict, state or {}, result, pg_ranks))
    nbytes = int(m.files[DATA_NAME]["nbytes"])
    parts, counts = run.everywhere("reading data", lambda: checksum.block_parts(read_items(
        comm, os.path.join(ckdir, DATA_NAME), rp.items, rp.dests, rp.dtypes, block_size=m.block_size,
        chunk_bytes=chunk_bytes, unchecked=rp.unchecked), nbytes, m.block_size))
    parts, counts = run.reduce_xor(parts), run.reduce_sum(counts)  # fixed-size, at the root
    run.on_root("verifying checksums", lambda: verify_data(ckdir, m, parts, counts))
    run.everywhere("setting state", lambda: [fn() for fn in rp.apply])
    if opt is not None:
        opt.after_load()
    return LoadResult(step=m.step, extra=m.extra, world_size=m.world_size, stage=m.stage, optimizer_loaded=has_opt,
                      manifest=m, path=ckdir, missing=match.missing, unexpected=match.unexpected,
                      mismatched=match.mismatched, state=result)


def _plan_load(comm: mpicomm.Communicator, m: Manifest, ckdir: str, model: torch.nn.Module,
               opt: OptimizerPlanner | None, strict: bool, state: dict[str, Any],
               result: dict[str, Any], pg_ranks: list[int | None]) -> tuple[ReadPlan, Match, bool]:
    """What this rank reads, how the model matches the checkpoint, and whether optimizer state loads;
    the steps that load the state items put them in ``result``."""
    model_state = ModelState.of(model)
    match = Match.of(model_state, m)
    if strict and not match.complete:
        raise StateMismatchError(match.message(ckdir))
    rp = ReadPlan(rank=comm.rank)
    has_opt = opt is not None and m.optimizer is not None
    if opt is not None:
        opt.check_load(match, ckdir, strict, comm.size)
    plan_model_load(model_state, m, match, rp, opt.loads_weights if opt is not None else None)
    section = m.state or {}
    if opt is not None:
        saved = section.get("optimizer") if has_opt else None
        loaded = items.plan_load("optimizer state", saved, m, rp) if saved is not None else None
        opt.plan_load(m, match.by_id, rp, has_opt, loaded.value if loaded and loaded.has_value else None)
        if loaded is not None and loaded.has_ranks:
            rp.apply.append(lambda: _load_per_rank(opt.per_rank_object(), "the optimizer", loaded, comm))
    for name, target in state.items():
        entry = section.get("items", {}).get(name)
        if entry is None:
            raise IncompatibleStateError(f"load: state item {name!r} is not in the checkpoint {ckdir}; it holds "
                                         f"{sorted(section.get('items', {}))}")
        loaded = items.plan_load(f"state item {name!r}", entry, m, rp, target)
        rp.apply.append(lambda n=name, t=target, ld=loaded: result.__setitem__(n, _load_item(n, t, ld, comm)))
    dtensor.check_meshes(rp.sharded, pg_ranks, "load")
    return rp, match, has_opt


def _load_per_rank(target: Any, what: str, loaded: items.Loaded, comm: mpicomm.Communicator) -> None:
    if target is None or not is_per_rank(target):
        raise IncompatibleStateError(f"load: {what} was saved with per-rank state; expected an object that loads "
                                     "it (ckpt.RNG(), ckpt.PerRank(obj), or load_per_rank_state_dict)")
    try:
        target.load_per_rank_state_dict(loaded.ranks(), comm.rank, comm.size)
    except IncompatibleStateError as exc:
        raise IncompatibleStateError(f"load: {what}: {exc}") from None


def _load_item(name: str, target: Any, loaded: items.Loaded, comm: mpicomm.Communicator) -> Any:
    """Load state item ``name`` into ``target``; return what ``LoadResult.state`` holds for it."""
    what = f"state item {name!r}"
    if is_stateful(target) and not loaded.has_value:
        raise IncompatibleStateError(f"load: {what} was saved per rank only; {type(target).__name__} expects a "
                                     "state_dict (wrap it in ckpt.PerRank(obj) to load per-rank state)")
    value = restore(target, loaded.value(), what) if loaded.has_value else target
    if loaded.has_ranks or is_per_rank(target):
        if not loaded.has_ranks:
            raise IncompatibleStateError(f"load: {what} was saved without per-rank state; "
                                         f"{type(target).__name__} expects it")
        _load_per_rank(target, what, loaded, comm)
    return value
