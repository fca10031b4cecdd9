"""Glue between DeepSpeed checkpoints and ours: ``from_deepspeed`` and ``to_deepspeed_universal``."""
from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Any

import torch

import mpicomm

from ..api import save
from ..collective import Collective
from ..dtypes import DTYPES
from ..errors import ChecksumError, IncompatibleStateError
from ..io import read_blocks
from zero import ShardLayout
from ..manifest import DamagedCheckpointError, Manifest, TensorEntry
from ..progress_bar import ProgressFn, report
from zero import ZeroOptimizer
from .reader import DeepSpeedState, read_deepspeed, split_names, verify_files
from ..storage import read_manifest, resolve
from .universal import write_params, write_shared

_DTYPES = DTYPES


def _tag_folder(path: str) -> str:
    """``path`` itself, or the tag its ``latest`` file names (DeepSpeed's save root)."""
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest) and not any(f.endswith("optim_states.pt") for f in os.listdir(path)):
        with open(latest) as f:
            return os.path.join(path, f.read().strip())
    return path


def _optimizer_class(state: DeepSpeedState) -> type[torch.optim.Optimizer]:
    if state.optimizer_class:
        cls = getattr(torch.optim, state.optimizer_class.rsplit(".", 1)[-1], None)
        if isinstance(cls, type):
            return cls
    decoupled = any(g.get("decoupled_weight_decay") for g in state.param_groups)
    return torch.optim.AdamW if decoupled else torch.optim.Adam


class _Skeleton(torch.nn.Module):
    """A module whose state dict has exactly the given names (dotted paths become submodules)."""

    def __init__(self, entries: "OrderedDict[str, tuple[torch.Tensor, bool]]") -> None:
        super().__init__()
        for name, (t, is_buffer) in entries.items():
            *path, leaf = name.split(".")
            mod: torch.nn.Module = self
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, torch.nn.Module())
                mod = mod._modules[part]
            if is_buffer:
                mod.register_buffer(leaf, t)
            else:
                mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=True))


def _needed(state: DeepSpeedState, layouts: list[tuple[list[str], ShardLayout]], rank: int) -> list[str]:
    """Parameters whose full tensors this rank needs: those in its shards, plus every weight
    that must be rebuilt from the fp32 masters (ZeRO-3 saves no weights) in a non-fp32 model."""
    need: set[str] = set()
    for names, layout in layouts:
        need.update(names[s.param] for s in layout.segments(rank))
    if state.dtype != torch.float32:
        need.update(n for n in state.names if state.model_state.get(n) is None
                    or state.model_state[n].numel() != state.numel(n))
    return [n for n in state.names if n in need]


def from_deepspeed(ds_checkpoint_dir: str | os.PathLike, path: str | os.PathLike, comm: Any = None,
                   allow_pickle: bool = False, overwrite: bool = False,
                   progress: ProgressFn | None = None) -> Manifest:
    """Import the DeepSpeed ZeRO-1/2/3 checkpoint in ``ds_checkpoint_dir`` (a tag folder, or the
    save root whose ``latest`` names one) as our checkpoint at ``path``.

    Collective over ``comm`` (None: mpicomm's world); each rank reads only the parameters of
    its own shard. The result holds the model weights (DeepSpeed's dtype), fp32 masters, the
    optimizer's exp_avg / exp_avg_sq / step and hyperparameters, sharded like a
    ``ZeroOptimizer`` over ``comm`` (ZeRO-1/2 as stage 1, ZeRO-3 as stage 2: each parameter split
    on its own, the ZeRO-3 partition); it loads with
    ``ckpt.load`` at any world size. DeepSpeed's files are pickles: they are loaded weights-only
    with an allowlist of DeepSpeed's classes (as inert stand-ins), so no code runs and any other
    global is refused; ``allow_pickle`` is accepted for compatibility and unnecessary. Every zip
    entry's CRC-32 is checked before use. ``progress`` is
    called with (phase, done, total) for this rank's reading and the collective write.
    """
    comm = mpicomm.as_communicator(comm)
    run = Collective(comm, "from_deepspeed")
    folder = os.path.abspath(os.fspath(ds_checkpoint_dir))
    # Each step below is local to its rank (no communication inside it), so a rank that fails
    # early cannot leave the others waiting in a collective of the step; the wrapper then
    # raises on every rank. Only "building" is collective (ZeroOptimizer's construction), and
    # it runs once every rank has read its part.
    tag = run.everywhere("finding the tag folder", lambda: _tag_folder(folder))
    run.everywhere("checking", lambda: verify_files(tag, comm.rank, comm.size))  # this rank's share
    meta = run.everywhere("reading the layout", lambda: read_deepspeed(tag, names=[], verify=False))
    state, by_group, stage = run.everywhere("reading", lambda: _read(tag, meta, comm, progress))
    zero, model, step, extra = run.everywhere("building", lambda: _build(tag, state, by_group, stage, comm))
    report(progress, "writing", 0, 1)
    m = save(path, model=model, optimizer=zero, step=step, comm=comm, extra=extra, overwrite=overwrite)
    report(progress, "writing", 1, 1)
    return m


def _read(folder: str, meta: DeepSpeedState, comm: mpicomm.Communicator, progress: ProgressFn | None
          ) -> tuple[DeepSpeedState, list[list[str]], int]:
    """The tensors of DeepSpeed checkpoint ``folder`` that this rank needs (no communication),
    with the parameter names of each group and our ZeRO stage."""
    stage = 2 if meta.stage == 3 else 1      # stage 2 splits each parameter as ZeRO-3 does
    by_group: list[list[str]] = [[n for n in meta.names if meta.group[n] == gi]
                                 for gi in range(len(meta.param_groups))]
    layouts = [(names, ShardLayout([meta.numel(n) for n in names], comm.size, stage)) for names in by_group]
    state = read_deepspeed(folder, names=_needed(meta, layouts, comm.rank), progress=progress, verify=False)
    return state, by_group, stage


def _build(folder: str, state: DeepSpeedState, by_group: list[list[str]], stage: int,
           comm: mpicomm.Communicator) -> tuple[ZeroOptimizer, torch.nn.Module, int | None, dict[str, Any]]:
    """This rank's part of the DeepSpeed checkpoint as a model and a ZeroOptimizer over ``comm``
    (collective: the ZeroOptimizer is built on every rank)."""
    entries: "OrderedDict[str, tuple[torch.Tensor, bool]]" = OrderedDict()
    order = list(state.model_state) + [n for n in state.names if n not in state.model_state]
    for name in order:
        if name in state.shapes:
            if name in state.tensors or (name in state.model_state
                                         and state.model_state[name].numel() == state.numel(name)):
                w = state.weight(name).detach().clone()
            else:  # fp32 weights are saved from the masters; the value here is never read
                w = torch.zeros(state.shapes[name], dtype=state.dtype)
            entries[name] = (w.reshape(state.shapes[name]), False)
        else:
            entries[name] = (state.model_state[name].detach().clone(), True)
    model = _Skeleton(entries)
    params = dict(model.named_parameters())
    groups = [{"params": [params[n] for n in names], **hp} for names, hp in zip(by_group, state.param_groups)]
    zero = ZeroOptimizer(_optimizer_class(state), groups, stage=stage, comm=comm)

    for gi, (g, names) in enumerate(zip(zero.groups, by_group)):
        shard = {k: torch.zeros(g.layout.local_numel, dtype=torch.float32) for k in ("exp_avg", "exp_avg_sq")}
        for s in g.layout.segments(comm.rank):
            full = state.tensors[names[s.param]]
            g.master[s.local:s.local + s.length].copy_(full["fp32"].reshape(-1)[s.start:s.start + s.length])
            for k, buf in shard.items():
                buf[s.local:s.local + s.length].copy_(full[k].reshape(-1)[s.start:s.start + s.length])
        st: dict[str, Any] = dict(shard)
        if state.step is not None:
            st["step"] = (torch.tensor(float(state.step), dtype=state.step_dtype)
                          if state.step_dtype is not None else state.step)
        zero.set_shard_state(gi, st)

    extra = {"imported_from": "deepspeed", "ds_version": state.ds_version, "ds_stage": state.stage,
             "ds_world_size": state.world_size, "source": folder}
    return zero, model, state.step, extra


def _read_entry(ckdir: str, m: Manifest, e: TensorEntry) -> torch.Tensor:
    """One tensor of our checkpoint, whole, after checking the CRC-32 of the blocks it spans."""
    fname = os.path.join(ckdir, e.file)
    fsize = int(m.files[e.file]["nbytes"])
    bs = m.block_size
    if e.nbytes:
        blocks = list(range(e.offset // bs, (e.offset + e.nbytes - 1) // bs + 1))
        crcs = read_blocks(fname, blocks, bs, fsize)
        bad = [b for b, c in zip(blocks, crcs) if c != m.files[e.file]["crc32"][b]]
        if bad:
            raise ChecksumError(f"{fname}: checksum mismatch in block(s) {bad} holding {e.name!r} ({e.kind})")
    with open(fname, "rb") as f:
        f.seek(e.offset)
        raw = bytearray(f.read(e.nbytes))
    if len(raw) != e.nbytes:
        raise DamagedCheckpointError(f"{fname}: expected {e.nbytes} bytes at offset {e.offset} for {e.name!r}, got {len(raw)}")
    dtype = _DTYPES[e.dtype]
    if not raw:
        return torch.empty(e.shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(e.shape)


def _scalar(d: dict[str, Any] | None) -> tuple[int | None, torch.dtype | None]:
    if not d:
        return None, None
    return int(d["value"]), (_DTYPES[d["dtype"]] if d.get("dtype") else None)


def to_deepspeed_universal(path: str | os.PathLike, out_dir: str | os.PathLike, comm: Any = None,
                           progress: ProgressFn | None = None) -> str:
    """Export our checkpoint at ``path`` as DeepSpeed's universal checkpoint in tag folder
    ``out_dir`` (``zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt``, ``zero/optimizer_state.pt``,
    model states files) and write ``<parent of out_dir>/latest_universal``; DeepSpeed loads it
    with ``"checkpoint": {"load_universal": true}`` at any data-parallel size and ZeRO stage.
    Collective over ``comm`` (None: mpicomm's world): the ranks share the per-parameter files
    and rank 0 writes the shared ones; a failure on any rank raises on every rank.
    Needs the optimizer state (the universal layout is optimizer state per parameter).
    ``progress`` is called with (phase, done, total) for this rank's reading and writing."""
    comm = mpicomm.as_communicator(comm)
    run = Collective(comm, "to_deepspeed_universal")
    out_dir = os.path.abspath(os.fspath(out_dir))
    state = run.everywhere("reading", lambda: _universal_state(path, comm, progress))
    run.everywhere("writing parameters", lambda: write_params(state, out_dir, progress))
    run.on_root("writing shared files", lambda: write_shared(state, out_dir))
    return out_dir


def _universal_state(path: str | os.PathLike, comm: mpicomm.Communicator,
                     progress: ProgressFn | None) -> DeepSpeedState:
    """Our checkpoint at ``path`` as a DeepSpeedState holding this rank's share of the parameters."""
    ckdir = resolve(path)
    m = read_manifest(ckdir)
    if not m.optimizer:
        raise IncompatibleStateError(f"to_deepspeed_universal: {ckdir} holds no optimizer state; DeepSpeed's universal "
                         "layout needs the fp32 masters and the optimizer state of every parameter")
    groups = m.optimizer["param_groups"]
    index = {i: gi for gi, g in enumerate(groups) for i in g["params"]}
    names = [m.params[i].name for g in groups for i in g["params"]]
    pidx = m.param_index()
    shapes = {m.params[i].name: tuple(m.params[i].shape) for i in index}
    dtypes = {m.params[i].dtype for i in index}
    dtype = _DTYPES[dtypes.pop()] if len(dtypes) == 1 else torch.float32
    owned = split_names(names, [math.prod(shapes[n]) for n in names], comm.size)[comm.rank]
    scalars = m.optimizer.get("scalars", {})
    step, step_dtype = _scalar(scalars.get(str(pidx[names[0]]), {}).get("step")) if names else (None, None)
    if step is None:
        step = m.step
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for n in owned:
        i = pidx[n]
        e = m.find("master", i) or m.find("param", i)
        if e is None:
            raise DamagedCheckpointError(f"to_deepspeed_universal: {ckdir} has no weights for {n!r}")
        t = {"fp32": _read_entry(ckdir, m, e).float()}
        for key in m.state_keys():
            se = m.find("state", i, key)
            if se is not None:
                t[key] = _read_entry(ckdir, m, se).float()
        tensors[n] = t
        report(progress, "reading", len(tensors), len(owned))
    buffers = OrderedDict()
    for i, p in enumerate(m.params):
        if i not in index and p.buffer:
            e = m.find("param", i)
            if e is not None:
                buffers[p.name] = _read_entry(ckdir, m, e).clone()
    extra = m.extra if isinstance(m.extra, dict) else {}
    hyper = []
    for g in groups:
        hp = {k: v for k, v in g.items() if k != "params"}
        if isinstance(hp.get("betas"), list):
            hp["betas"] = tuple(hp["betas"])
        hyper.append(hp)
    return DeepSpeedState(
        stage=int(m.stage or 1), world_size=int(m.world_size), dtype=dtype, names=names, shapes=shapes,
        group={m.params[i].name: gi for i, gi in index.items()}, param_groups=hyper, step=step,
        step_dtype=step_dtype, model_state=buffers, buffer_names=list(buffers),
        optimizer_class=m.optimizer.get("class"), ds_version=extra.get("ds_version"), owned=owned,
        tensors=tensors)
