"""A ZeroOptimizer group's shards put back together in parameter order (pure, no MPI)."""
from __future__ import annotations

from typing import Any, Sequence

import torch


def is_elementwise(value: Any, master: torch.Tensor) -> bool:
    """Whether an optimizer state entry holds one value per master element (``exp_avg``)."""
    return isinstance(value, torch.Tensor) and value.shape == master.shape and value.dim() == 1


def split_state(state: dict[str, Any], master: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a shard's optimizer state into per-element tensors and the rest (``step``)."""
    elementwise = {k: v for k, v in state.items() if is_elementwise(v, master)}
    other = {k: v for k, v in state.items() if k not in elementwise}
    return elementwise, other


def assemble(layout: Any, rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Join every old rank's local shard (``rows[r]``, ``layout.local_numel`` elements) into
    the group's unpadded flat buffer in parameter order (``layout.total_numel`` elements)."""
    if len(rows) != layout.world_size:
        raise ValueError(f"expected {layout.world_size} rows, got {len(rows)}")
    offsets = [0]
    for n in layout.numels:
        offsets.append(offsets[-1] + n)
    index = {pid: i for i, pid in enumerate(layout.param_ids)}
    out = torch.empty(layout.total_numel, dtype=rows[0].dtype, device=rows[0].device)
    for r, row in enumerate(rows):
        if row.numel() != layout.local_numel:
            raise ValueError(f"row {r}: expected {layout.local_numel} elements, got {row.numel()}")
        for s in layout.segments(r):
            lo = offsets[index[s.param]] + s.start
            out[lo:lo + s.length].copy_(row.reshape(-1)[s.local:s.local + s.length])
    return out
