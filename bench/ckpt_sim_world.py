"""The simulated world of ``bench ckpt --simulate-ranks``: the model's shapes (published Llama
configs or given sizes), the device mesh of each layout, and the model and optimizer a rank of an
N-rank job holds (DTensors with meta-device shards on a fake process group, or ZeRO-1's flat
shard), without data or MPI."""
from __future__ import annotations

import contextlib
import math
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
    """The placements of every state tensor under ``fsdp2`` (Shard(0)) or ``hsdp`` (Replicate, Shard(0))."""
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
def rank_state(layout: str, rank: int, n: int, group: int, shapes: list[tuple[str, tuple[int, ...]]],
               with_state: bool) -> Iterator[tuple[Any, Any]]:
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
