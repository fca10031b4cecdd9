"""The sharded (ZeRO-style) optimizer: fp32 master weights and optimizer state split over ranks.

    from zero import ZeroOptimizer
    opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), stage=2, comm=comm, lr=1e-3,
                        gather_bits=8)      # stage 1: state sharded; 2: gradients too; int8 gather
    loss.backward(); opt.step(); opt.zero_grad()

Gradients are averaged onto their shard owners from backward hooks, the wrapped optimizer steps
on the shard, and the weights are all-gathered back. ``ckpt.save``/``ckpt.load`` save it like
any optimizer, at any world size, through its public shard groups (``ShardGroup``).

What lives where:
    optimizer   ZeroOptimizer: construction, gradient hooks, step and the weight all-gather
    grad_norm   the averaged gradient's norm and checks (one small allreduce), clip_grad_norm_
    shard_access  what ckpt and elastic use: ShardGroup (one parameter group's shard on this rank),
                shard_state, layouts_for, rebind, the update hooks
    partition   which elements each rank owns: ShardLayout, Segment, split_evenly (pure, no MPI)
    buckets     the bucket plan (once, for both directions); gradient reduction from backward hooks
    quantize    symmetric int8 per block for the weight all-gather (gather_bits=8; pure, no MPI)
    inner       which wrapped optimizers can run on a shard
    onebit      1-bit Adam on the shards (compressed reduce-scatter onto the owners)

Layering: accelerators <- mpicomm <- compressed <- zero <- ckpt <- bench.
"""
from __future__ import annotations

from .optimizer import ZeroOptimizer
from .shard_access import ShardGroup
from .partition import STAGES, Segment, ShardLayout, ceil_div, split_evenly
from .quantize import GATHER_BITS

__all__ = ["GATHER_BITS", "STAGES", "Segment", "ShardGroup", "ShardLayout", "ZeroOptimizer", "ceil_div",
           "split_evenly"]
