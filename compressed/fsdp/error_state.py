"""The 1-bit reduce-scatters' error feedback under a model as one ckpt per-rank state item.

``GradientErrors(model)`` finds every FSDPModule under ``model`` whose reduce-scatter is a
``QuantizedReduceScatter(bits=1)``; ``ckpt.save(..., state={"grad_errors": GradientErrors(m)})``
stores each rank's worker errors (fp32, never a copy of weights) and ``ckpt.load`` with the
same item gives them back. At the saved shard-group size every rank takes its own (a resume is
bit-identical); at another size the error mass is carried over as for the 1-bit optimizers
(``compressed.reshard``): each saved rank's error is put back on the parameters' positions
(FSDP2's dim-0 chunks; its padding and the wire's dropped), the mean over saved ranks is what
the mean gradient owes, and every new rank takes that mean, laid out as its own rows. Each
module's step count (its warm-up's progress) is saved too and comes back at any size (the
largest saved; a checkpoint without one, from before the warm-up, counts as past it).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from .collectives import QuantizedReduceScatter
from .install import param_groups
from .onebit import padded_row

__all__ = ["GradientErrors", "unpack", "pack"]


def _chunk(d0: int, world: int) -> int:
    return -(-d0 // world)


def _inner(shape) -> int:
    n = 1
    for s in shape[1:]:
        n *= int(s)
    return n


def unpack(error: torch.Tensor, shapes: list[list[int]], world: int) -> list[torch.Tensor]:
    """A worker error (world x padded_row(m) fp32, rows as FSDP2 lays out its reduce-scatter
    input: row j holds dim-0 chunk j of every parameter) as one float64 tensor per parameter
    of ``shapes`` (padding dropped)."""
    m = sum(_chunk(s[0], world) * _inner(s) for s in shapes)
    want = world * padded_row(m)
    if error.numel() != want:
        raise ValueError(f"GradientErrors: a saved worker error has {error.numel()} elements; "
                         f"expected {want} for parameters {shapes} at {world} ranks")
    rows = error.detach().reshape(world, -1)[:, :m].to("cpu", torch.float64)
    out, pos = [], 0
    for shape in shapes:
        c, inner = _chunk(shape[0], world), _inner(shape)
        piece = rows[:, pos:pos + c * inner].reshape(world * c, inner)[:shape[0]]
        out.append(piece.reshape(shape))
        pos += c * inner
    return out


def pack(params: list[torch.Tensor], world: int) -> torch.Tensor:
    """``unpack``'s inverse for ``world`` ranks: fp32 (world x padded_row(m)), zero padding."""
    segs = []
    for p in params:
        c, inner = _chunk(p.shape[0], world), _inner(p.shape)
        padded = torch.zeros(c * world, inner, dtype=torch.float64)
        padded[:p.shape[0]] = p.reshape(p.shape[0], inner)
        segs.append(padded.reshape(world, c * inner))
    rows = torch.cat(segs, dim=1) if segs else torch.zeros(world, 0, dtype=torch.float64)
    m = rows.shape[1]
    out = torch.zeros(world, padded_row(m), dtype=torch.float32)
    out[:, :m] = rows.to(torch.float32)
    return out.reshape(-1)


def _module_info(module: FSDPModule) -> tuple[int, list[list[int]], int]:
    """(shard-group size, parameter shapes in FSDP2's order, shard numel) of a module."""
    group = param_groups(module)[0]
    shapes = []
    for p in group.fsdp_params:
        if p.fsdp_placement.dim != 0:
            raise ValueError(f"GradientErrors: parameter {p._param_fqn!r} is sharded on dim "
                             f"{p.fsdp_placement.dim}; the error state handles dim-0 shards only")
        shapes.append([int(s) for s in p._orig_size])
    world = int(group.mesh_info.shard_mesh_size)
    m = sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params)
    return world, shapes, m


class GradientErrors:
    """Per-rank ckpt state of the 1-bit reduce-scatters' worker errors under ``model``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.targets: dict[str, tuple[FSDPModule, QuantizedReduceScatter]] = {}
        for name, m in model.named_modules():
            if not isinstance(m, FSDPModule):
                continue
            groups = param_groups(m)
            comm = getattr(groups[0], "_reduce_scatter_comm", None) if groups else None
            if isinstance(comm, QuantizedReduceScatter) and comm.bits == 1:
                self.targets[name or "<root>"] = (m, comm)
        if not self.targets:
            raise ValueError(f"GradientErrors: no FSDPModule under {type(model).__name__} has a "
                             "1-bit reduce-scatter; call compressed.fsdp.quantize_comms(model, "
                             "grad_bits=1) first")

    def per_rank_state_dict(self) -> dict[str, Any]:
        """``{"modules": {name: {"world_size", "shapes", "numel", "worker_error", "steps"}}}``
        (``steps``: the reduce-scatter's calls so far, its warm-up included)."""
        modules = {}
        for name, (m, comm) in self.targets.items():
            world, shapes, numel = _module_info(m)
            st = comm.onebit
            st.shape_check(world, numel)
            e = st.worker_error
            if e is None:
                e = torch.zeros(world * padded_row(numel), dtype=torch.float32)
            modules[name] = {"world_size": world, "shapes": shapes, "numel": numel,
                             "worker_error": e.detach().clone(), "steps": st.steps}
        return {"modules": modules}

    def load_per_rank_state_dict(self, saved: list[dict], rank: int, size: int) -> None:
        """Take this rank's errors from every saved rank's (in rank order), resharded when the
        shard-group size or the parameters' layout changed."""
        for i, st in enumerate(saved):
            if sorted(st.get("modules", {})) != sorted(self.targets):
                raise ValueError(f"GradientErrors: saved rank {i} holds errors for modules "
                                 f"{sorted(st.get('modules', {}))}; this model's 1-bit modules "
                                 f"are {sorted(self.targets)}")
        for name, (m, comm) in self.targets.items():
            world, shapes, numel = _module_info(m)
            entries = [st["modules"][name] for st in saved]
            if any([list(s) for s in e["shapes"]] != shapes for e in entries):
                raise ValueError(f"GradientErrors: module {name!r} was saved with parameter "
                                 f"shapes {entries[0]['shapes']}, this model has {shapes}")
            if len(saved) == size and all(int(e["world_size"]) == world for e in entries):
                mine = entries[rank]["worker_error"]
            else:
                owed = None
                for e in entries:
                    parts = unpack(e["worker_error"], shapes, int(e["world_size"]))
                    owed = parts if owed is None else [a + b for a, b in zip(owed, parts)]
                mine = pack([t / len(entries) for t in owed], world)
            counts = [e.get("steps") for e in entries if e.get("steps") is not None]
            comm.onebit.load_state_dict({"world_size": world, "numel": numel,
                                         "worker_error": mine,
                                         "steps": max(counts) if counts else None})
