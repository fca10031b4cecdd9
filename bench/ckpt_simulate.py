"""``python -m bench ckpt --simulate-ranks N``: ckpt's save and load planning for an N-rank job, in
one process, beside torch DCP's planning of the same state.

Each sampled rank (first, middle, last) gets the metadata it would hold in a real job: a model of
the named shapes whose parameters (and AdamW's ``exp_avg`` / ``exp_avg_sq``) are DTensors with
meta-device local shards, on a device mesh of a fake process group of N ranks (no data, no MPI).
It then runs the planning steps ``ckpt.save`` and ``ckpt.load`` run on that rank (``ckpt.api``'s
own functions), fed what the collectives between them would deliver, synthesised for N ranks
(every rank's summary is the sampled rank's with its own process-group rank: a job whose ranks
agree). The root's work after the writes is the block checksums from the fixed-size reduction,
the manifest checks and its JSON. DCP: ``DefaultSavePlanner.create_local_plan`` on a sampled
rank, then ``create_global_plan`` over N local plans (built with DCP's own per-rank functions for
every rank), then ``DefaultLoadPlanner.create_local_plan`` against the metadata it made.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import pickle
import sys
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable, Iterator

MODELS = {  # published configs (Meta Llama 3)
    "llama-8b": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256},
    "llama-70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672, "vocab": 128256},
}
LAYOUTS = ("fsdp2", "hsdp", "fsdp2-tp", "zero1")
#: llama's modules as torch's tensor parallel shards them (torchtitan's plan): ColwiseParallel
#: (Shard(0) of the weight on the TP mesh dim) for q/k/v/gate/up and the head, RowwiseParallel for
#: o/down (Shard(1)) and the embedding (an nn.Embedding's rowwise: Shard(0)); the norms
#: (SequenceParallel) replicated over TP
TP_DIM0 = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head", "embed_tokens")
TP_DIM1 = ("o_proj", "down_proj")
#: the layouts torch DCP's planning is simulated for (DCP saves no ZeroOptimizer; its per-rank
#: plans here are built for one mesh and one placement per state)
DCP_LAYOUTS = ("fsdp2", "hsdp")
CONFIG_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")


def parse_model(text: str) -> dict[str, int]:
    """A model name of MODELS, or ``layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256``."""
    if text in MODELS:
        return dict(MODELS[text])
    try:
        cfg = {k: int(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        cfg = {}
    if set(cfg) != set(CONFIG_KEYS) or min(cfg.values()) < 1 or cfg["hidden"] % cfg["heads"]:
        raise ValueError(f"--model: expected one of {sorted(MODELS)} or {','.join(k + '=INT' for k in CONFIG_KEYS)} "
                         f"(hidden a multiple of heads), got {text!r}")
    return cfg


def llama_shapes(cfg: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """The state dict names and shapes of a Llama model (untied embedding and head)."""
    h, f, v = cfg["hidden"], cfg["ffn"], cfg["vocab"]
    kv = cfg["kv_heads"] * (h // cfg["heads"])
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def mesh_shape(layout: str, n: int, group: int) -> tuple[int, ...]:
    """The device mesh of ``layout`` over ``n`` ranks: FSDP2 and ZeRO-1 (n,), HSDP (replicas,
    ``group`` = the shard group), FSDP2 x TP (n / ``group``, ``group`` = the TP size)."""
    if layout in ("fsdp2", "zero1"):
        return (n,)
    if layout in ("hsdp", "fsdp2-tp"):
        if n % group:
            flag = "--shard-group" if layout == "hsdp" else "--tp-size"
            raise ValueError(f"--layout {layout}: expected --simulate-ranks and --load-ranks multiples of "
                             f"{flag}={group}, got {n}")
        return (n // group, group)
    raise ValueError(f"--layout: expected one of {LAYOUTS}, got {layout!r}")


def placements(layout: str) -> tuple[Any, ...]:
    from torch.distributed.tensor import Replicate, Shard

    return (Shard(0),) if layout == "fsdp2" else (Replicate(), Shard(0))


def tensor_spec(layout: str, name: str, mesh: Any, group: int) -> tuple[Any, tuple[Any, ...]]:
    """The mesh and placements of state tensor ``name`` (a parameter's name) under ``layout``.

    fsdp2-tp as ``parallelize_module`` on the TP dim then ``fully_shard`` on the FSDP dim give
    them: a weight of TP Shard(0) (_StridedShard(0, split_factor=TP), Shard(0)), of TP Shard(1)
    (Shard(0), Shard(1)), a norm (Shard(0), Replicate())."""
    if layout != "fsdp2-tp":
        return mesh, placements(layout)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    module = name.split(".")[-2]
    if module in TP_DIM0:
        return mesh, (_StridedShard(0, split_factor=group), Shard(0))
    if module in TP_DIM1:
        return mesh, (Shard(0), Shard(1))
    return mesh, (Shard(0), Replicate())


@contextlib.contextmanager
def fake_world(rank: int, size: int, shape: tuple[int, ...]) -> Iterator[Any]:
    """torch.distributed's default group as a fake group of ``size`` ranks (this process is
    ``rank``) and a CPU device mesh of ``shape`` on it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        # names unique to the rank: torch reuses an equal DeviceMesh of an earlier world (its coordinate with it)
        names = (f"dp{rank}",) if len(shape) == 1 else (f"outer{rank}", f"inner{rank}")
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


def meta_dtensor(shape: tuple[int, ...], mesh: Any, places: tuple[Any, ...], dtype: Any) -> Any:
    """A DTensor of global ``shape`` laid out by ``places`` on ``mesh``; its local shard is on the
    meta device, of the shape torch's chunk rule gives this rank."""
    import torch
    from torch.distributed.tensor import DTensor

    from ckpt import dtensor_layout as dl

    coord = mesh.get_coordinate()
    lay = dl.layout(shape, tuple(mesh.mesh.shape), coord, places)
    loc = torch.empty(dl.local_shape(lay), dtype=dtype, device="meta")
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return DTensor.from_local(loc, mesh, places, run_check=False, shape=torch.Size(shape), stride=stride)


def _module(shapes: list[tuple[str, tuple[int, ...]]], make: Callable[[str, tuple[int, ...]], Any]) -> Any:
    """A module holding a parameter ``make(name, shape)`` under each name."""
    import torch

    model = torch.nn.Module()
    for name, shape in shapes:
        *path, leaf = name.split(".")
        mod = model
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(make(name, shape)))
    return model


def build_state(shapes: list[tuple[str, tuple[int, ...]]], mesh: Any, layout: str, group: int,
                with_state: bool) -> tuple[Any, Any]:
    """A module holding the named DTensor parameters (fp32) laid out as ``layout`` says and an
    AdamW over them, with its state (step, exp_avg, exp_avg_sq) filled as after a step when
    ``with_state``."""
    import torch

    specs = {name: tensor_spec(layout, name, mesh, group) for name, _ in shapes}
    model = _module(shapes, lambda name, shape: meta_dtensor(shape, *specs[name], torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if with_state:
        for name, p in model.named_parameters():
            opt.state[p] = {"step": torch.tensor(1.0),
                            "exp_avg": meta_dtensor(tuple(p.shape), *specs[name], torch.float32),
                            "exp_avg_sq": meta_dtensor(tuple(p.shape), *specs[name], torch.float32)}
    return model, opt


def build_zero1(shapes: list[tuple[str, tuple[int, ...]]], rank: int, n: int, with_state: bool) -> tuple[Any, Any]:
    """A replicated model (meta parameters, fp32) and the ``zero.ZeroOptimizer(AdamW, stage=1)``
    rank ``rank`` of ``n`` holds over it: one group, its fp32 master shard (meta) of
    ``ShardLayout``'s flat partition, and AdamW's state of the shard when ``with_state``. Made
    without the constructor, which copies the weights and plans gradient buckets over every
    rank's segments (training work, not a checkpoint's)."""
    import torch

    from zero import ShardGroup, ShardLayout, ZeroOptimizer

    model = _module(shapes, lambda _name, shape: torch.empty(shape, dtype=torch.float32, device="meta"))
    ps = list(model.parameters())
    layout = ShardLayout([p.numel() for p in ps], n, 1)
    master = torch.empty(layout.local_numel, dtype=torch.float32, device="meta")
    opt = ZeroOptimizer.__new__(ZeroOptimizer)
    opt.comm, opt.stage, opt.optimizer_class = FakeComm(rank, n), 1, torch.optim.AdamW
    opt.world_size, opt.rank, opt.gather_bits = n, rank, None
    opt._groups = [ShardGroup(ps, layout, master, torch.float32)]
    opt.optimizer = torch.optim.AdamW([{"params": [master]}], lr=1e-4)
    hyper = {k: v for k, v in opt.optimizer.param_groups[0].items() if k != "params"}
    torch.optim.Optimizer.__init__(opt, [{**hyper, "params": ps}], dict(opt.optimizer.defaults))
    opt._built = True
    if with_state:
        opt.optimizer.state[master] = {"step": torch.tensor(1.0),
                                       "exp_avg": torch.empty_like(master), "exp_avg_sq": torch.empty_like(master)}
    return model, opt


@contextlib.contextmanager
def rank_state(layout: str, rank: int, n: int, group: int, shapes, with_state: bool) -> Iterator[tuple[Any, Any]]:
    """The model and optimizer rank ``rank`` of ``n`` holds under ``layout`` (DTensor layouts:
    inside a fake world of ``n`` ranks)."""
    if layout == "zero1":
        yield build_zero1(shapes, rank, n, with_state)
        return
    with fake_world(rank, n, mesh_shape(layout, n, group)) as mesh:
        yield build_state(shapes, mesh, layout, group, with_state)


@dataclass
class FakeComm:
    """What the planning functions ask of a communicator: its rank and size."""

    rank: int
    size: int


@dataclass
class Measured:
    seconds: float
    peak_bytes: int
    value: Any


def count_calls(fn: Callable[[], Any]) -> int:
    """How many Python and C function calls ``fn()`` makes: its work, counted, not timed."""
    calls = 0

    def prof(_frame, event, _arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def measure(fn: Callable[[], Any], memory_below_s: float = math.inf) -> Measured:
    """``fn()``'s wall time (a plain run), then, when that took under ``memory_below_s``, its peak
    Python heap growth (tracemalloc, which slows Python down, in a second run; else -1); the
    first run's value."""
    gc.collect()
    t0 = time.perf_counter()
    value = fn()
    dt = time.perf_counter() - t0
    if dt >= memory_below_s:
        return Measured(dt, -1, value)
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return Measured(dt, peak, value)


def sample_ranks(n: int) -> list[int]:
    return sorted({0, n // 2, n - 1})


def ckpt_save_rank(rank: int, n: int, shapes, layout: str, group: int, block_size: int,
                   chunk_bytes: int, count: bool = False, memory: bool = True) -> dict[str, Any]:
    """Run ckpt.save's planning steps of ``rank`` of ``n``; return its figures and plans (with
    ``count``, also "calls": the function calls the planning makes; without ``memory``, no peak)."""
    from ckpt import api, io
    from ckpt.optimizers import planner_for

    with rank_state(layout, rank, n, group, shapes, True) as (model, opt):
        comm = FakeComm(rank, n)
        planner = planner_for(opt)

        def plan(summaries):
            prepared = planner.prepare_save(n)
            sp, manifest, captured, summary = api._plan_save(comm, model, planner, prepared, 1, None, {}, block_size,
                                                             chunk_bytes)
            if summaries is None:  # what the allgather of the summaries delivers: every rank's, in rank order
                summaries = [dict(summary, **{"@pg": None if summary["@pg"] is None else q}) for q in range(n)]
            mine = api._plan_writes(comm, manifest, sp, captured, summaries)
            rounds = io._plan(mine, set(range(len(sp.buffers))), chunk_bytes, block_size)
            return summary, summaries, manifest, mine, rounds

        summaries = plan(None)[1]
        got = measure(lambda: plan(summaries), math.inf if memory else 0)
        summary, _s, manifest, mine, rounds = got.value
        calls = count_calls(lambda: plan(summaries)) if count else None
        npieces = sum(len(range(c.offset // block_size, (c.offset + c.nbytes - 1) // block_size + 1))
                      for r in rounds for c in r)
        return {"rank": rank, "seconds": got.seconds, "peak_bytes": got.peak_bytes, "summary": summary, "manifest": manifest,
                "items": mine, "rounds": len(rounds), "pieces": npieces,
                "summary_bytes": len(pickle.dumps(summary)), "calls": calls}


def ckpt_root_commit(manifest: Any) -> Measured:
    """The root's commit work once the data is written: block CRCs from the reduced per-block
    parts, the manifest's checks and JSON (the reduction's values are synthesised: zeros)."""
    import numpy as np

    from ckpt import checksum
    from ckpt.manifest import DATA_NAME

    f = manifest.files[DATA_NAME]
    nblocks = checksum.num_blocks(int(f["nbytes"]), manifest.block_size)
    parts = np.zeros(nblocks, np.uint32)
    counts = np.array([min(manifest.block_size, int(f["nbytes"]) - b * manifest.block_size) for b in range(nblocks)],
                      np.int64)

    def commit():
        f["crc32"] = checksum.blocks_from_parts(parts, counts, int(f["nbytes"]), manifest.block_size)
        manifest.validate()
        return manifest.to_json()

    return measure(commit)


def ckpt_load_rank(rank: int, m: int, text: str, shapes, layout: str, group: int, block_size: int,
                   chunk_bytes: int, memory: bool = True) -> dict[str, Any]:
    """Run ckpt.load's planning steps of ``rank`` of ``m`` on the manifest ``text``."""
    from ckpt import api, checksum, io
    from ckpt.manifest import Manifest
    from ckpt.optimizers import planner_for

    with rank_state(layout, rank, m, group, shapes, False) as (model, opt):
        planner = planner_for(opt)
        pgs = [None] * m if layout == "zero1" else list(range(m))  # no torch.distributed group under ZeRO

        def plan():
            # as ckpt.load: rank 0 reads the file and checks it all (its CRC, every field), the
            # others parse the bytes it broadcasts
            man = Manifest.from_json(text, checked=rank != 0)
            rp, _match, _has = api._plan_load(FakeComm(rank, m), man, "<simulated>", model, planner, True, {}, {}, pgs)
            itemsize = {i: 4 for i in range(len(rp.dests))}
            rounds = io._plan(rp.items, set(range(len(rp.dests))), chunk_bytes, block_size, itemsize)
            return rp, rounds

        got = measure(plan, math.inf if memory else 0)
        rp, rounds = got.value
        nblocks = checksum.num_blocks(int(json.loads(text)["files"]["data.bin"]["nbytes"]), block_size)
        return {"rank": rank, "seconds": got.seconds, "peak_bytes": got.peak_bytes, "ranges": len(rp.items),
                "checksum_reduce_bytes": nblocks * 12, "reported": len(rp.dests) - len(rp.unchecked),
                "dests": len(rp.dests),
                "rounds": len(rounds), "bytes": sum(it.nbytes for it in rp.items), "items": rp.items}


# --- torch DCP ------------------------------------------------------------------------------------

def dcp_state_dict(model: Any, opt: Any) -> dict[str, Any]:
    """The flat state dict a DCP user saves: the model's DTensors and AdamW's state by name."""
    sd: dict[str, Any] = {f"model.{k}": v for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            sd[f"optim.state.{names[id(p)]}.{k}"] = v
    return sd


def dcp_local_plan(rank: int, n: int, shapes, layout: str, group: int) -> Measured:
    """DefaultSavePlanner's local plan of ``rank`` of ``n`` for the same state (timed)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    with rank_state(layout, rank, n, group, shapes, True) as (model, opt):
        sd = dcp_state_dict(model, opt)

        def run():
            planner = DefaultSavePlanner()
            planner.set_up_planner(sd, None, rank == 0)
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


def dcp_global(plans: list[Any]) -> Measured:
    from torch.distributed.checkpoint import DefaultSavePlanner

    def run():
        planner = DefaultSavePlanner()
        planner.set_up_planner({}, None, True)
        return planner.create_global_plan(plans)

    return measure(run, memory_below_s=30)


def dcp_load_rank(rank: int, m: int, metadata: Any, shapes, layout: str, group: int) -> Measured:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    with rank_state(layout, rank, m, group, shapes, True) as (model, opt):
        sd = dcp_state_dict(model, opt)

        def run():
            planner = DefaultLoadPlanner()
            planner.set_up_planner(sd, metadata, rank == 0)
            return planner.create_local_plan()

        return measure(run)


# --- the program ----------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench ckpt --simulate-ranks N", description=__doc__.splitlines()[0])
    p.add_argument("--simulate-ranks", type=int, required=True, metavar="N", help="ranks of the simulated save")
    p.add_argument("--load-ranks", type=int, default=None, metavar="M", help="ranks of the simulated load (default N)")
    p.add_argument("--model", default="llama-70b", help=f"{' or '.join(MODELS)} (default llama-70b), or "
                   + ",".join(k + "=INT" for k in CONFIG_KEYS))
    p.add_argument("--layout", choices=LAYOUTS, default="fsdp2",
                   help="fsdp2: dim-0 Shard over N; hsdp: Replicate x Shard(0) over (N / shard group, shard group); "
                        "fsdp2-tp: FSDP2 over N / TP size x tensor parallel over TP size (colwise q/k/v/gate/up/head, "
                        "rowwise o/down/embedding, norms replicated); zero1: replicated model, zero.ZeroOptimizer(AdamW, stage=1) over N")
    p.add_argument("--shard-group", type=int, default=8, help="hsdp: ranks that shard a replica (default 8)")
    p.add_argument("--tp-size", type=int, default=8, help="fsdp2-tp: ranks of a tensor-parallel group (default 8)")
    p.add_argument("--dcp", choices=("yes", "no"), default="yes", help="also time torch DCP's planning (default yes)")
    p.add_argument("--dcp-limit-s", type=float, default=600.0,
                   help="stop DCP's planning for a rank count once it takes longer than this (default 600)")
    p.add_argument("--json", default=None, help="write the figures as JSON to this file")
    return p


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 0 else "not measured (a second, traced run would take as long again)"


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from ckpt.manifest import DEFAULT_BLOCK_SIZE
    from ckpt.io import DEFAULT_CHUNK_BYTES

    n, m = args.simulate_ranks, args.load_ranks or args.simulate_ranks
    if n < 1 or m < 1:
        print("bench ckpt: expected --simulate-ranks and --load-ranks >= 1", flush=True)
        return 2
    args.group = args.tp_size if args.layout == "fsdp2-tp" else args.shard_group
    if args.dcp == "yes" and args.layout not in DCP_LAYOUTS:
        print(f"bench ckpt: --layout {args.layout}: torch DCP's planning is simulated for {' and '.join(DCP_LAYOUTS)} "
              "only (DCP saves no ZeroOptimizer; the simulated DCP plans take one mesh and placement for every "
              "tensor); pass --dcp no", flush=True)
        return 2
    if args.group < 1:
        print("bench ckpt: expected --shard-group and --tp-size >= 1", flush=True)
        return 2
    try:
        cfg = parse_model(args.model)
        mesh_shape(args.layout, n, args.group)
        mesh_shape(args.layout, m, args.group)
    except ValueError as exc:
        print(f"bench ckpt: {exc}", flush=True)
        return 2
    shapes = llama_shapes(cfg)
    nparams = sum(math.prod(s) for _, s in shapes)
    print(f"simulated ckpt planning: {args.model} ({len(shapes)} tensors, {nparams / 1e9:.2f}B parameters, fp32 + "
          f"AdamW), {args.layout}, save at {n} ranks, load at {m} ranks", flush=True)
    out: dict[str, Any] = {"model": args.model, "layout": args.layout, "save_ranks": n, "load_ranks": m,
                           "tensors": len(shapes), "parameters": nparams, "save": [], "load": []}
    block, chunk = DEFAULT_BLOCK_SIZE, DEFAULT_CHUNK_BYTES
    saved = None
    for r in sample_ranks(n):
        res = ckpt_save_rank(r, n, shapes, args.layout, args.group, block, chunk)
        saved = saved or res
        if res["summary"]["@table"] != saved["summary"]["@table"]:
            raise AssertionError(f"rank {r} planned another table than rank {saved['rank']}")
        nblocks = -(-int(res["manifest"].files["data.bin"]["nbytes"]) // block)
        print(f"  save rank {r:>6}: planning {res['seconds']:.3f} s, peak {_mib(res['peak_bytes'])}; "
              f"{len(res['items'])} write ranges in {res['rounds']} rounds; collectives per rank: summary "
              f"allgather {res['summary_bytes']} B sent, {res['summary_bytes'] * n:,} B received; checksum reduce "
              f"{nblocks * 12:,} B (a block's CRC part and byte count)", flush=True)
        out["save"].append({k: res[k] for k in ("rank", "seconds", "peak_bytes", "rounds", "pieces", "summary_bytes")}
                           | {"write_ranges": len(res["items"]), "checksum_reduce_bytes": nblocks * 12})
    root = ckpt_root_commit(saved["manifest"])
    text = root.value
    print(f"  root commit: {root.seconds:.3f} s, peak {_mib(root.peak_bytes)}; manifest {len(text):,} B "
          f"({_mib(len(text))}); data file {int(saved['manifest'].files['data.bin']['nbytes']) / 1e9:.1f} GB",
          flush=True)
    out["root"] = {"seconds": root.seconds, "peak_bytes": root.peak_bytes, "manifest_bytes": len(text)}
    for r in sample_ranks(m):
        res = ckpt_load_rank(r, m, text, shapes, args.layout, args.group, block, chunk)
        print(f"  load rank {r:>6} of {m}: planning {res['seconds']:.3f} s, peak {_mib(res['peak_bytes'])}; "
              f"{res['ranges']} byte ranges ({res['bytes'] / 1e9:.2f} GB) in {res['rounds']} rounds; manifest "
              f"broadcast {len(text):,} B; checksum reduce {res['checksum_reduce_bytes']:,} B (the CRCs of "
              f"{res['reported']} of its {res['dests']} tensors read; another rank reports the rest)",
              flush=True)
        out["load"].append({k: res[k] for k in ("rank", "seconds", "peak_bytes", "ranges", "rounds", "bytes",
                                                "checksum_reduce_bytes", "reported")})
    if args.dcp == "yes":
        out["dcp"] = _dcp(n, m, shapes, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _dcp(n: int, m: int, shapes, args) -> dict[str, Any]:
    """DCP's planning of the same state at n ranks (a rank's local plan, the coordinator's global
    plan over every rank's) and a load rank's local plan at m, within --dcp-limit-s."""
    limit = args.dcp_limit_s
    local = dcp_local_plan(0, n, shapes, args.layout, args.group)
    t0 = time.perf_counter()
    try:
        plans = dcp_other_plans(local.value, n, args.layout, args.group, t0 + limit)
    except TimeoutError:
        print(f"  DCP: making the {n} ranks' local plans took over --dcp-limit-s={limit:g} s; not timed", flush=True)
        return {"finished": False, "limit_s": limit, "local_s": local.seconds}
    g = dcp_global(plans)
    gathered = len(pickle.dumps(plans))
    del plans
    over = f" (over --dcp-limit-s={limit:g})" if g.seconds > limit else ""
    print(f"  DCP save: local plan {local.seconds:.3f} s (rank 0), peak {_mib(local.peak_bytes)}; create_global_plan "
          f"over {n} ranks {g.seconds:.3f} s{over}, peak {_mib(g.peak_bytes)}; local plans gathered at the "
          f"coordinator {gathered:,} B", flush=True)
    res: dict[str, Any] = {"finished": g.seconds <= limit, "limit_s": limit, "local_s": local.seconds,
                           "global_s": g.seconds, "global_peak_bytes": g.peak_bytes, "gathered_bytes": gathered}
    _global, metadata = g.value
    ld = dcp_load_rank(m // 2, m, metadata, shapes, args.layout, args.group)
    print(f"  DCP load: local plan of rank {m // 2} of {m} {ld.seconds:.3f} s, peak {_mib(ld.peak_bytes)}", flush=True)
    res["load_local_s"] = ld.seconds
    res["load_peak_bytes"] = ld.peak_bytes
    return res
