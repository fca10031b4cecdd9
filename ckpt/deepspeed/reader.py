"""Read a DeepSpeed ZeRO checkpoint tag folder into a neutral, per-parameter description."""
from __future__ import annotations

import glob
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import CheckpointError, CheckpointNotFoundError
from ..progress_bar import ProgressFn, report
from .pickles import Loader, check_files

STATE_KEYS = ("exp_avg", "exp_avg_sq")
TENSOR_KEYS = ("fp32",) + STATE_KEYS

_OPTIM = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_Z3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL = "mp_rank_00_model_states.pt"


class DeepSpeedFormatError(CheckpointError, ValueError):
    """The folder is not a DeepSpeed ZeRO checkpoint this reader understands."""


@dataclass
class DeepSpeedState:
    """A DeepSpeed ZeRO checkpoint, unflattened: one full tensor per parameter and key.

    ``names`` lists the trainable parameters in DeepSpeed's order (group by group), ``group``
    gives each one's optimizer param group, ``param_groups`` the groups' hyperparameters
    (without ``params``). ``tensors[name]`` holds full-shape fp32 ``"fp32"`` (master weights),
    ``"exp_avg"`` and ``"exp_avg_sq"``, for the parameters this process read (``owned``; all of
    them without a communicator). ``model_state`` is the model's state dict as DeepSpeed saved
    it (weights in ``dtype`` and buffers; ZeRO-3 saves no weights: see ``weight``).
    """

    stage: int
    world_size: int
    dtype: torch.dtype
    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    group: dict[str, int]
    param_groups: list[dict[str, Any]]
    step: int | None
    step_dtype: torch.dtype | None
    model_state: "OrderedDict[str, torch.Tensor]"
    buffer_names: list[str]
    optimizer_class: str | None
    ds_version: str | None
    owned: list[str]
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def numel(self, name: str) -> int:
        return math.prod(self.shapes[name])

    def weight(self, name: str) -> torch.Tensor:
        """The model weight of ``name`` in the model dtype (from the fp32 master under ZeRO-3)."""
        w = self.model_state.get(name)
        if w is not None and w.numel() == self.numel(name):
            return w
        return self.tensors[name]["fp32"].to(self.dtype)


def split_names(names: Sequence[str], numels: Sequence[int], parts: int) -> list[list[str]]:
    """Cut ``names`` (in order) into ``parts`` consecutive runs of nearly equal total numel."""
    total = sum(numels)
    out: list[list[str]] = [[] for _ in range(parts)]
    acc = 0
    for name, n in zip(names, numels):
        mid = acc + n / 2
        part = min(parts - 1, int(mid * parts / total)) if total else 0
        out[part].append(name)
        acc += n
    return out


def _optim_files(folder: str) -> list[tuple[int, str]]:
    found = []
    for path in glob.glob(os.path.join(folder, "*optim_states.pt")):
        m = _OPTIM.match(os.path.basename(path))
        if m is None:
            continue
        if int(m.group(2)) != 0:
            raise DeepSpeedFormatError(f"{path}: tensor/pipeline parallel checkpoints (mp_rank > 0) "
                                       "are not supported; expected mp_rank_00 only")
        found.append((int(m.group(1)), path))
    found.sort()
    ranks = [r for r, _ in found]
    if not found:
        raise DeepSpeedFormatError(f"no ZeRO optimizer files (*zero_pp_rank_*_mp_rank_00_optim_states.pt) "
                                   f"in {folder}")
    if ranks != list(range(len(ranks))):
        raise DeepSpeedFormatError(f"{folder}: expected optimizer files for ranks 0..{len(ranks) - 1}, "
                                   f"found ranks {ranks}")
    return found


def _model_file(folder: str) -> str:
    plain = os.path.join(folder, _MODEL)
    if os.path.isfile(plain):
        return plain
    z3 = sorted(p for p in glob.glob(os.path.join(folder, "zero_pp_rank_*_mp_rank_00_model_states.pt"))
                if _Z3_MODEL.match(os.path.basename(p)))
    if not z3:
        raise DeepSpeedFormatError(f"no model states file ({_MODEL} or zero_pp_rank_0_mp_rank_00_"
                                   f"model_states.pt) in {folder}")
    return min(z3, key=lambda p: int(_Z3_MODEL.match(os.path.basename(p)).group(1)))


def _optimizer_class(ds_config: Any) -> str | None:
    """The torch optimizer DeepSpeed built from its config ("Adam" means AdamW unless
    ``adam_w_mode`` is false), or None when the config does not say."""
    opt = ds_config.get("optimizer") if isinstance(ds_config, dict) else None
    if not isinstance(opt, dict) or not isinstance(opt.get("type"), str):
        return None
    kind = opt["type"].lower()
    params = opt.get("params") or {}
    if kind in ("adam", "adamw"):
        adamw = kind == "adamw" or bool(params.get("adam_w_mode", True))
        return "torch.optim.AdamW" if adamw else "torch.optim.Adam"
    for name in dir(torch.optim):
        if name.lower() == kind and isinstance(getattr(torch.optim, name), type):
            return f"torch.optim.{name}"
    return None


def _stage(optim_sd: dict[str, Any]) -> int:
    stage = optim_sd.get("zero_stage", 1)
    try:
        return int(stage)
    except (TypeError, ValueError):
        raise DeepSpeedFormatError(f"unreadable zero_stage {stage!r}") from None


def _step(state: dict[str, Any]) -> tuple[int | None, torch.dtype | None]:
    s = state.get("step")
    if s is None:
        return None, None
    if isinstance(s, torch.Tensor):
        return int(s.item()), s.dtype
    return int(s), None


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def verify_files(folder: str | os.PathLike, rank: int = 0, size: int = 1) -> None:
    """Check the CRC-32 and size of rank ``rank``'s share (of ``size``) of the zip entries of
    DeepSpeed tag folder ``folder``; a damaged entry raises ZipEntryError here (no communication:
    run it through ckpt's Collective to raise on every rank)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CheckpointNotFoundError(f"no DeepSpeed checkpoint folder at {folder}")
    check_files([_model_file(folder)] + [p for _, p in _optim_files(folder)], rank, size)


def read_deepspeed(folder: str | os.PathLike, allow_pickle: bool = False, comm: Any = None,
                   names: Sequence[str] | None = None, progress: ProgressFn | None = None,
                   verify: bool = True) -> DeepSpeedState:
    """Read the DeepSpeed ZeRO-1/2/3 checkpoint in tag folder ``folder``.

    Without ``names``, each rank of ``comm`` (an mpicomm Communicator; None: this process
    alone) reads the full tensors of its share of the parameters (``owned``), a consecutive
    run of about 1/size of the elements; with ``names``, exactly those. DeepSpeed's files are
    memory-mapped, so a rank touches only the bytes of its parameters. Files are unpickled
    weights-only: DeepSpeed's own classes become inert stand-ins and any other Python global
    is refused (PickleRefusedError), so no flag is needed and ``allow_pickle`` (accepted for
    compatibility) changes nothing. With ``verify`` every zip entry's CRC-32 and size is
    checked first (shared among the ranks of ``comm``; a damaged entry raises ZipEntryError on
    every rank). ``progress`` is called with ("reading", parameters done, parameters to read).
    """
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CheckpointNotFoundError(f"no DeepSpeed checkpoint folder at {folder}")
    loader = Loader(verify=False)
    model_path = _model_file(folder)
    optim_files = _optim_files(folder)
    if verify:
        mpi = getattr(comm, "mpi_comm", None)
        if mpi is not None and mpi.Get_size() > 1:
            check_files([model_path] + [p for _, p in optim_files], mpi.Get_rank(), mpi.Get_size(), mpi.allgather)
        else:
            check_files([model_path] + [p for _, p in optim_files])
    model_sd = loader.load(model_path)
    optim = [(r, loader.load(p)) for r, p in optim_files]
    world = len(optim)
    osd0 = optim[0][1].get("optimizer_state_dict")
    if not isinstance(osd0, dict):
        raise DeepSpeedFormatError(f"{folder}: optimizer file lacks 'optimizer_state_dict'")
    stage = _stage(osd0)
    shapes_groups = model_sd.get("param_shapes")
    if not isinstance(shapes_groups, list):
        raise DeepSpeedFormatError(f"{model_path}: expected 'param_shapes' as a list of groups, "
                                   f"got {type(shapes_groups).__name__}")
    module = model_sd.get("module") or OrderedDict()
    dp = model_sd.get("dp_world_size")
    if dp is not None and int(dp) != world:
        raise DeepSpeedFormatError(f"{folder}: dp_world_size is {dp} but there are {world} optimizer files")

    all_names: list[str] = []
    shapes: dict[str, tuple[int, ...]] = {}
    for g in shapes_groups:
        for n, s in g.items():
            all_names.append(n)
            shapes[n] = tuple(int(d) for d in s)
    if names is not None:
        unknown = [n for n in names if n not in shapes]
        if unknown:
            raise KeyError(f"read_deepspeed: no parameters {unknown} in {folder}")
        owned = list(names)
    elif comm is None:
        owned = list(all_names)
    else:
        owned = split_names(all_names, [math.prod(shapes[n]) for n in all_names], comm.size)[comm.rank]

    _check_adam_state(osd0, stage, folder)
    if stage == 3 and model_sd.get("frozen_param_shapes"):
        raise DeepSpeedFormatError(f"{model_path}: frozen (requires_grad=False) parameters under ZeRO-3 "
                                   f"are not supported: {list(model_sd['frozen_param_shapes'])[:5]}")
    if stage <= 2:
        base = osd0.get("base_optimizer_state")
        if not isinstance(base, dict):
            raise DeepSpeedFormatError(f"{folder}: expected 'base_optimizer_state' as a dict (elastic "
                                       f"ZeRO checkpoints are not supported), got {type(base).__name__}")
        pgroups = base["param_groups"]
        if len(pgroups) != len(shapes_groups):
            raise DeepSpeedFormatError(f"{folder}: {len(shapes_groups)} parameter groups in param_shapes, "
                                       f"{len(pgroups)} in the optimizer")
        group = {n: gi for gi, g in enumerate(shapes_groups) for n in g}
        step, step_dtype = _step(base["state"].get(0, {}))
        tensors = _unflatten_zero12(optim, owned, group, shapes, module, folder, progress)
    else:
        inner = osd0["optimizer_state_dict"]
        pgroups = inner["param_groups"]
        sub_to_group = {int(i): gi for gi, g in enumerate(pgroups) for i in g["params"]}
        group = {n: sub_to_group.get(si, 0) for si, g in enumerate(shapes_groups) for n in g}
        step, step_dtype = _step(inner["state"].get(0, {}))
        tensors = _unflatten_zero3(optim, owned, shapes_groups, shapes, folder, progress)

    dtype = _model_dtype(module, all_names)
    buffer_names = list(model_sd.get("buffer_names") or [])
    return DeepSpeedState(stage=stage, world_size=world, dtype=dtype, names=all_names, shapes=shapes,
                          group=group, param_groups=[_hyper(g) for g in pgroups], step=step,
                          step_dtype=step_dtype, model_state=OrderedDict(module), buffer_names=buffer_names,
                          optimizer_class=_optimizer_class(model_sd.get("ds_config")),
                          ds_version=model_sd.get("ds_version"), owned=owned, tensors=tensors)


def _check_adam_state(osd: dict[str, Any], stage: int, folder: str) -> None:
    inner = osd.get("base_optimizer_state") if stage <= 2 else osd.get("optimizer_state_dict")
    states = inner.get("state") if isinstance(inner, dict) else None
    if not isinstance(states, dict) or not states:
        raise DeepSpeedFormatError(f"{folder}: the optimizer holds no state (saved before its first step?)")
    for gi, st in states.items():
        missing = [k for k in STATE_KEYS if k not in st]
        if missing:
            raise DeepSpeedFormatError(f"{folder}: expected Adam-style optimizer state {list(STATE_KEYS)} in "
                                       f"group {gi}, found {sorted(st)}")


def _model_dtype(module: dict[str, torch.Tensor], names: list[str]) -> torch.dtype:
    for n in names:
        t = module.get(n)
        if isinstance(t, torch.Tensor):
            return t.dtype
    return torch.float32


def _cut(flat: torch.Tensor, start: int, numel: int, what: Callable[[], str]) -> torch.Tensor:
    """``numel`` elements of the flat partition ``flat`` from ``start``; a DeepSpeedFormatError
    (``what()`` names them) if they run past its end."""
    if start + numel > flat.numel():
        raise DeepSpeedFormatError(f"{what()} partition of {flat.numel()} elements")
    return flat.narrow(0, start, numel)


def _unflatten_zero12(optim: list[tuple[int, dict]], owned: list[str], group: dict[str, int],
                      shapes: dict[str, tuple[int, ...]], module: dict[str, torch.Tensor],
                      folder: str, progress: ProgressFn | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """ZeRO-1/2: each rank's flat partition of each group holds fragments of parameters, where
    its ``param_slice_mappings`` say; a parameter is its fragments in rank order."""
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {n: {k: [] for k in TENSOR_KEYS} for n in owned}
    for rank, sd in optim:
        osd = sd["optimizer_state_dict"]
        mappings = osd["param_slice_mappings"]
        fp32 = osd["single_partition_of_fp32_groups"]
        states = osd["base_optimizer_state"]["state"]
        for n in owned:
            gi = group[n]
            frag = mappings[gi].get(n)
            if frag is None:
                continue
            start, numel = int(frag.start), int(frag.numel)
            flats = {"fp32": fp32[gi], **{k: states[gi][k] for k in STATE_KEYS}}
            for k, flat in flats.items():
                pieces[n][k].append(_cut(flat, start, numel, lambda: f"{folder}: rank {rank} fragment of {n!r} "
                                         f"[{start}, {start + numel}) exceeds its {k}"))
    out = {}
    for n in owned:
        shape, numel = shapes[n], math.prod(shapes[n])
        got = {k: (torch.cat(v) if v else None) for k, v in pieces[n].items()}
        if got["fp32"] is None:
            # no fragment: the parameter never reached the optimizer; keep its model value
            w = module.get(n)
            if w is None or w.numel() != numel:
                raise DeepSpeedFormatError(f"{folder}: no optimizer fragments and no weights for {n!r}")
            got = {"fp32": w.float().reshape(-1), **{k: torch.zeros(numel) for k in STATE_KEYS}}
        for k, t in got.items():
            if t.numel() != numel:
                raise DeepSpeedFormatError(f"{folder}: {n!r} {k}: fragments hold {t.numel()} elements, "
                                           f"expected {numel} for shape {shape}")
        out[n] = {k: t.reshape(shape).clone() for k, t in got.items()}
        report(progress, "reading", len(out), len(owned))
    return out


def _unflatten_zero3(optim: list[tuple[int, dict]], owned: list[str], shapes_groups: list[dict],
                     shapes: dict[str, tuple[int, ...]], folder: str,
                     progress: ProgressFn | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """ZeRO-3: every parameter is split alone into ceil(numel / P)-element pieces; rank r's flat
    sub-group holds its piece of each parameter in turn, each padded to full piece size."""
    where: dict[str, tuple[int, int]] = {}  # name -> (sub group, offset of its piece in a flat partition)
    for si, g in enumerate(shapes_groups):
        off = 0
        for n in g:
            where[n] = (si, off)
            off += math.ceil(math.prod(shapes[n]) / len(optim))
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {n: {k: [] for k in TENSOR_KEYS} for n in owned}
    for rank, sd in optim:
        osd = sd["optimizer_state_dict"]
        parts = osd.get("partition_count", len(optim))
        if isinstance(parts, (list, tuple)):
            parts = parts[0]
        if int(parts) != len(optim):
            raise DeepSpeedFormatError(f"{folder}: partition_count {parts} differs from the {len(optim)} "
                                       "optimizer files (hierarchical ZeRO-3 partitioning is not supported)")
        flats = osd["fp32_flat_groups"]
        states = osd["optimizer_state_dict"]["state"]
        for n in owned:
            si, off = where[n]
            numel = math.prod(shapes[n])
            piece = math.ceil(numel / len(optim))
            valid = max(0, min(piece, numel - rank * piece))
            for k, flat in (("fp32", flats[si]), *((k, states[si][k]) for k in STATE_KEYS)):
                pieces[n][k].append(_cut(flat, off, valid, lambda: f"{folder}: rank {rank} piece of {n!r} "
                                         f"exceeds its {k}"))
    out = {}
    for n in owned:
        out[n] = {k: torch.cat(v).reshape(shapes[n]).clone() for k, v in pieces[n].items()}
        report(progress, "reading", len(out), len(owned))
    return out
