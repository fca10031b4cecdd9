"""The sharded (ZeRO-style) optimizer: fp32 master weights and optimizer state split over ranks.

    from zero import ZeroOptimizer
    opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), stage=1, comm=comm, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

Gradients are averaged onto their shard owners from backward hooks, the wrapped optimizer steps
on the shard, and the weights are all-gathered back. ``ckpt.save``/``ckpt.load`` save it like
any optimizer, at any world size, through its public shard groups (``ShardGroup``).

What lives where:
    optimizer   ZeroOptimizer and ShardGroup (one parameter group's shard on this rank)
    partition   which elements each rank owns: ShardLayout, Segment, split_evenly (pure, no MPI)
    buckets     gradient reduction onto the owners in buckets, from backward hooks
    inner       which wrapped optimizers can run on a shard
    onebit      1-bit Adam on the shards (compressed reduce-scatter onto the owners)

Layering: accelerators <- mpicomm <- compressed <- zero <- ckpt <- bench.
"""
from __future__ import annotations

from .optimizer import ShardGroup, ZeroOptimizer
from .partition import STAGES, Segment, ShardLayout, ceil_div, split_evenly

__all__ = ["STAGES", "Segment", "ShardGroup", "ShardLayout", "ZeroOptimizer", "ceil_div", "split_evenly"]
