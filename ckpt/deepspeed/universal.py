"""Write DeepSpeed's universal checkpoint layout from a neutral DeepSpeedState."""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

from ..progress_bar import ProgressFn, report
from .reader import DeepSpeedState

UNIVERSAL_VERSION = 0.4          # DeepSpeed's universal_checkpoint_version that this layout matches
DEFAULT_DS_VERSION = "0.19.0"    # DeepSpeed refuses optimizer state without a ds_version
LATEST = "latest_universal"
MODEL_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def _save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _step_value(state: DeepSpeedState) -> Any:
    if state.step is None:
        return None
    if state.step_dtype is None:
        return int(state.step)
    return torch.tensor(state.step, dtype=state.step_dtype)


def write_param(state: DeepSpeedState, name: str, zero_dir: str) -> None:
    """Write ``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`` for one parameter."""
    d = os.path.join(zero_dir, name)
    os.makedirs(d, exist_ok=True)
    for key, t in state.tensors[name].items():
        # a compact copy: torch.save writes a view's whole storage
        _save({"cat_dim": 0, "param": t.detach().reshape(state.shapes[name]).clone()},
              os.path.join(d, f"{key}.pt"))
    step = _step_value(state)
    if step is not None:
        _save(step, os.path.join(d, "step.pt"))


def write_buffers(state: DeepSpeedState, zero_dir: str) -> None:
    """Write ``zero/<buffer>/fp32.pt`` (as float32) for the model's buffers, as DeepSpeed's own
    converter does for every model entry that has no optimizer state."""
    for name in state.buffer_names:
        t = state.model_state.get(name)
        if t is None or name in state.shapes:
            continue
        d = os.path.join(zero_dir, name)
        os.makedirs(d, exist_ok=True)
        _save({"param": t.detach().float().clone()}, os.path.join(d, "fp32.pt"))


def optimizer_state(state: DeepSpeedState) -> dict[str, Any]:
    """``zero/optimizer_state.pt``: the global optimizer state that both DeepSpeed's ZeRO-1/2
    and ZeRO-3 universal loaders read (plain data only)."""
    groups = []
    for gi, g in enumerate(state.param_groups):
        groups.append({**g, "params": [gi]})
    step = _step_value(state)
    inner_state = {gi: {"step": step} for gi in range(len(groups))} if step is not None else {}
    return {
        "zero_stage": int(state.stage),
        "overflow": False,
        "partition_count": int(state.world_size),
        "ds_version": state.ds_version or DEFAULT_DS_VERSION,
        "param_groups": groups,
        "optimizer_state_dict": {"state": inner_state, "param_groups": groups},
    }


def model_states(state: DeepSpeedState) -> dict[str, Any]:
    """The model states file: metadata DeepSpeed reads on a universal load, and the buffers
    (the weights themselves live in ``zero/<name>/fp32.pt``)."""
    shapes = []
    for gi in range(len(state.param_groups)):
        shapes.append(OrderedDict((n, torch.Size(state.shapes[n])) for n in state.names
                                  if state.group[n] == gi))
    buffers = OrderedDict((n, state.model_state[n]) for n in state.buffer_names if n in state.model_state)
    step = int(state.step or 0)
    return {
        "module": buffers,
        "buffer_names": list(state.buffer_names),
        "optimizer": None,
        "param_shapes": shapes,
        "frozen_param_shapes": None,
        "shared_params": {},
        "frozen_param_fragments": None,
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": step,
        "dp_world_size": int(state.world_size),
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_version": state.ds_version or DEFAULT_DS_VERSION,
        "universal_checkpoint_info": {"universal_checkpoint_version": UNIVERSAL_VERSION},
    }


def write_universal(state: DeepSpeedState, out_dir: str | os.PathLike, comm: Any = None,
                    progress: ProgressFn | None = None) -> str:
    """Write ``state`` as a DeepSpeed universal checkpoint in tag folder ``out_dir`` and point
    ``<parent>/latest_universal`` at it; DeepSpeed loads it with ``"checkpoint":
    {"load_universal": true}`` at any data-parallel size. Under ``comm`` every rank writes the
    parameters it holds (``state.owned``) and rank 0 the shared files; ``progress`` is called
    with ("writing", parameters done, this rank's parameters). Returns ``out_dir``."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    write_params(state, out_dir, progress)
    mpi = comm.mpi_comm if comm is not None else None
    if mpi is not None:
        mpi.Barrier()
    if mpi is None or mpi.Get_rank() == 0:
        write_shared(state, out_dir)
    if mpi is not None:
        mpi.Barrier()
    return out_dir


def write_params(state: DeepSpeedState, out_dir: str, progress: ProgressFn | None = None) -> None:
    """Write the per-parameter files of the parameters this rank holds (``state.owned``)."""
    zero_dir = os.path.join(out_dir, "zero")
    os.makedirs(zero_dir, exist_ok=True)
    missing = [n for n in state.owned if n not in state.tensors]
    if missing:
        raise ValueError(f"write_universal: no tensors for owned parameters {missing[:5]}")
    for i, name in enumerate(state.owned):
        write_param(state, name, zero_dir)
        report(progress, "writing", i + 1, len(state.owned))


def write_shared(state: DeepSpeedState, out_dir: str) -> None:
    """Write the files one process writes: optimizer state, buffers, model states, ``latest_universal``."""
    zero_dir = os.path.join(out_dir, "zero")
    os.makedirs(zero_dir, exist_ok=True)
    _save(optimizer_state(state), os.path.join(zero_dir, "optimizer_state.pt"))
    write_buffers(state, zero_dir)
    ms = model_states(state)
    for f in MODEL_FILES:
        _save(ms, os.path.join(out_dir, f))
    parent, tag = os.path.split(out_dir)
    with open(os.path.join(parent, LATEST), "w") as fh:
        fh.write(tag)
