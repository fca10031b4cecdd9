"""``quantize_comms``: install the quantized collectives on every FSDPModule under a module."""
from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from .collectives import DEFAULT_BLOCK, QuantizedAllGather, QuantizedReduceScatter, check_bits
from .onebit import check_warmup

__all__ = ["quantize_comms", "param_groups"]


def param_groups(module: FSDPModule) -> list:
    """The module's FSDP parameter groups: torch 2.13 keeps a list (``_fsdp_param_groups``, one
    per mesh); older torch (2.11 checked) at most one (``_fsdp_param_group``)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _segments(module: FSDPModule) -> tuple[int, ...]:
    """The per-rank shard sizes of the module's parameters, in FSDP2's all-gather order."""
    group = param_groups(module)[0]
    return tuple(p.padded_sharded_param_size.numel() for p in group.fsdp_params)


def quantize_comms(module: torch.nn.Module, weight_bits: int | None = 8,
                   grad_bits: int | None = 8, block: int = DEFAULT_BLOCK,
                   warmup_steps: int | None = None) -> list[str]:
    """Install int8 weight all-gathers and int8 (``grad_bits=8``) or 1-bit (``grad_bits=1``,
    error feedback per module) gradient reduce-scatters on every FSDPModule under ``module``;
    ``None`` leaves that side as FSDP2's own. ``warmup_steps`` (1-bit only; None: 20): the
    steps whose gradients are reduce-scattered at full precision before 1-bit starts. Returns
    the modules' names."""
    weight_bits = check_bits(weight_bits, (None, 8), "quantize_comms weight_bits")
    grad_bits = check_bits(grad_bits, (None, 8, 1), "quantize_comms grad_bits")
    warmup_steps = check_warmup(warmup_steps, grad_bits, "quantize_comms")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"quantize_comms: expected a torch.nn.Module, got {type(module).__name__}")
    found = [(name or "<root>", m) for name, m in module.named_modules()
             if isinstance(m, FSDPModule)]
    if not found:
        raise ValueError(f"quantize_comms: no FSDPModule under {type(module).__name__}; call "
                         "torch.distributed.fsdp.fully_shard on it (or its submodules) first")
    targets = []
    for name, m in found:
        groups = param_groups(m)
        if len(groups) > 1:
            raise ValueError(f"quantize_comms: FSDPModule {name!r} ({type(m).__name__}) has "
                             f"{len(groups)} parameter groups (a per-parameter mesh from "
                             "shard_placement_fn); torch accepts custom collectives only on a "
                             "module with one parameter group")
        if groups:
            targets.append((name, m))
    for name, m in targets:
        segments = _segments(m)
        if weight_bits is not None:
            m.set_custom_all_gather(QuantizedAllGather(weight_bits, block, segments))
        if grad_bits is not None:
            m.set_custom_reduce_scatter(QuantizedReduceScatter(grad_bits, block, segments,
                                                                warmup_steps))
    return [name for name, _ in targets]
