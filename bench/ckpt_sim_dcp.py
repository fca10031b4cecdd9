"""torch DCP's planning of the simulated state: ``DefaultSavePlanner.create_local_plan`` on a rank,
``create_global_plan`` over every rank's local plan (built with DCP's own per-rank functions), and
``DefaultLoadPlanner.create_local_plan`` against the metadata it made; and, before a large N is
built, the memory and time it would take, estimated from the same steps at two small N."""
from __future__ import annotations

import gc
import math
import pickle
import time
from dataclasses import dataclass
from typing import Any

from bench import memory
from bench.ckpt_sim_plan import Measured, count_calls, measure
from bench.ckpt_sim_world import mesh_shape, placements, rank_state

#: the rank counts DCP's planning is first run at, to estimate it at N (hsdp: the smaller one
#: rounded up to a multiple of the shard group, the larger 4x it)
CALIBRATION_RANKS = (32, 8)
#: how much more memory than the two-point estimate a run must find available
SAFETY = 1.5


def dcp_state_dict(model: Any, opt: Any) -> dict[str, Any]:
    """The flat state dict a DCP user saves: the model's DTensors and AdamW's state by name."""
    sd: dict[str, Any] = {f"model.{k}": v for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            sd[f"optim.state.{names[id(p)]}.{k}"] = v
    return sd


def dcp_local_plan(rank: int, n: int, shapes: list[tuple[str, tuple[int, ...]]], layout: str, group: int,
                   metadata: Any = None) -> Measured:
    """DCP's local plan of ``rank`` of ``n`` for the same state (timed): DefaultSavePlanner's, or
    with ``metadata`` DefaultLoadPlanner's against it."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    with rank_state(layout, rank, n, group, shapes, True) as (model, opt):
        sd = dcp_state_dict(model, opt)

        def run():
            planner = DefaultSavePlanner() if metadata is None else DefaultLoadPlanner()
            planner.set_up_planner(sd, metadata, rank == 0)
            return planner.create_local_plan()

        return measure(run)


def dcp_other_plans(template: Any, n: int, layout: str, group: int, deadline: float) -> list[Any]:
    """Every rank's local plan: ``template`` (rank 0's) with each shard's chunk as torch's rule
    gives it on that rank (``_compute_local_shape_and_global_offset``, which
    ``compute_local_shape_and_global_offset`` calls with the rank's mesh coordinate: here the
    coordinate is computed, no fake world is made per rank); other items as on rank 0. Raises
    TimeoutError past ``deadline``."""
    import dataclasses

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    places = placements(layout)
    shape_of_mesh = mesh_shape(layout, n, group)
    plans = [template]
    for q in range(1, n):
        coord = [q] if len(shape_of_mesh) == 1 else [q // shape_of_mesh[1], q % shape_of_mesh[1]]  # row-major, as init_device_mesh
        boxes: dict[tuple[int, ...], tuple[Any, Any]] = {}
        items = []
        for it in template.items:
            if it.type != WriteItemType.SHARD:
                items.append(it)
                continue
            shape = tuple(it.tensor_data.size)
            if shape not in boxes:
                sizes, offsets = _compute_local_shape_and_global_offset(shape, shape_of_mesh, coord, places)
                boxes[shape] = torch.Size(sizes), torch.Size(offsets)
            sizes, offsets = boxes[shape]
            items.append(WriteItem(index=MetadataIndex(it.index.fqn, offsets), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes),
                                                               it.tensor_data.properties, it.tensor_data.size)))
        plans.append(dataclasses.replace(template, items=items))
        if time.perf_counter() > deadline:
            raise TimeoutError
    return plans


def dcp_global(plans: list[Any], traced: bool = True) -> Measured:
    """DefaultSavePlanner's global plan over ``plans`` (timed; with ``traced``, its Python heap peak
    too when it takes under 30 s)."""
    return measure(lambda: _global_planner().create_global_plan(plans), memory_below_s=30 if traced else 0)


def _global_planner() -> Any:
    """A DefaultSavePlanner set up as the coordinator's, before it is given the local plans."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    planner = DefaultSavePlanner()
    planner.set_up_planner({}, None, True)
    return planner


@dataclass
class Estimate:
    """DCP's save planning at ``n`` ranks, estimated from two small rank counts: the memory it
    holds at its peak (a line in the ranks) and ``create_global_plan``'s seconds,
    ``linear_s * n + square_s * n * n`` (its overlap check sweeps, per tensor, over every chunk
    still open, which is all of them when the sweep runs along a dimension not sharded)."""

    n: int
    fixed_kib: float
    per_rank_kib: float
    linear_s: float
    square_s: float
    calibrated_at: tuple[int, ...]

    def global_s_at(self, n: int) -> float:
        return self.linear_s * n + self.square_s * n * n

    def ranks_within(self, seconds: float) -> int:
        """The most ranks whose estimated ``create_global_plan`` takes at most ``seconds``."""
        a, b = self.linear_s, self.square_s
        if b > 0:
            return int((math.sqrt(a * a + 4 * b * seconds) - a) / (2 * b))
        return int(seconds / a) if a > 0 else self.n


def save_pipeline(template: Any, n: int, layout: str, group: int, deadline: float = math.inf,
                  traced: bool = True) -> tuple[list[Any], Measured, int]:
    """Every rank's local plan from ``template``, the global plan over them and the bytes they are
    when gathered: what the save side holds at once."""
    plans = dcp_other_plans(template, n, layout, group, deadline)
    g = dcp_global(plans, traced)
    gathered = len(pickle.dumps(plans))
    return plans, g, gathered


def estimate(n: int, shapes: list[tuple[str, tuple[int, ...]]], layout: str, group: int) -> Estimate:
    """Run DCP's save planning at CALIBRATION_RANKS (untraced, as at a large N) and fit memory
    (peak resident growth, larger count first so that memory kept from it makes the other's growth
    look smaller and the per-rank growth larger) and time (the function calls of
    ``create_global_plan``, counted, at the seconds a call of the larger count) to them."""
    lo = -(-CALIBRATION_RANKS[1] // group) * group if layout == "hsdp" else CALIBRATION_RANKS[1]
    ks = (CALIBRATION_RANKS[0] // CALIBRATION_RANKS[1] * lo, lo)
    grown, secs, calls, floor = {}, {}, {}, 0.0
    for k in ks:
        local = dcp_local_plan(0, k, shapes, layout, group)
        gc.collect()
        base = memory.rss_kib()
        exact = memory.reset_peak_rss() is None
        _plans, g, gathered = save_pipeline(local.value, k, layout, group, traced=False)
        secs[k] = g.seconds
        grown[k] = (memory.rss_kib("VmHWM") if exact else memory.rss_kib()) - base
        floor = max(floor, gathered / k / 1024)  # a rank's plan is held, and is no smaller than its pickle
        calls[k] = count_calls(lambda held=_plans: _global_planner().create_global_plan(held))
        del _plans, g, local
    lo, hi = min(ks), max(ks)
    fixed, per = memory.linear_fit(lo, grown[lo], hi, grown[hi])
    per = max(per, floor)
    # the work, counted (no noise), is a line in n per rank; its seconds a call as at the larger count
    linear, square = memory.linear_fit(lo, calls[lo] / lo, hi, calls[hi] / hi)
    per_call = secs[hi] / calls[hi]
    return Estimate(n, fixed, per, linear * per_call, square * per_call, ks)


def decline(n: int, est: Estimate, limit_s: float, available_kib: int | None = None, step: int = 1) -> str | None:
    """None when DCP's planning at ``n`` ranks fits in memory (SAFETY margin) and its estimated
    ``create_global_plan`` in 1.5 x ``limit_s``; else the one-line note saying what it would need
    and the most ranks (a multiple of ``step``) that fit."""
    fit = memory.memory_fit(est.fixed_kib, est.per_rank_kib, n, SAFETY, available_kib)
    max_s = 1.5 * limit_s
    secs = est.global_s_at(n)
    if fit.fits and secs <= max_s:
        return None
    ranks = min(fit.largest_fitting, est.ranks_within(max_s)) // step * step
    why = []
    if not fit.fits:
        why.append(f"it would hold about {memory.gib(fit.need_kib)} ({est.per_rank_kib / 1024:.2f} MiB a rank, "
                   f"x{SAFETY:g} margin) where {memory.gib(fit.available_kib)} is available")
    if secs > max_s:
        why.append(f"create_global_plan would take about {secs / 60:.0f} min, over 1.5 x --dcp-limit-s={limit_s:g} s")
    at = " and ".join(map(str, sorted(est.calibrated_at)))
    return (f"  DCP: not run at {n} ranks: {'; '.join(why)} (estimated from DCP's planning at {at} ranks); "
            + (f"run it at --simulate-ranks {ranks} or fewer, or pass --dcp no" if ranks else
               "it fits at no rank count here; pass --dcp no"))
