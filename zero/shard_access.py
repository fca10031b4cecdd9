"""What ckpt and elastic use of a ZeroOptimizer: its shard groups, the wrapped optimizer's state of
each shard, the layouts at another world size, ``rebind`` onto a new communicator, and the hooks
around the shard update.

``ShardAccess`` is a part of ``ZeroOptimizer`` (its base); ``ShardGroup`` is one parameter group's
shard on this rank. Checkpointing reads and writes a ZeroOptimizer through these alone; elastic
training also re-partitions it with ``layouts_for`` and ``rebind`` and watches its updates.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .buckets import GradReducer
from .onebit import ShardedOnebitAdam
from .partition import ShardLayout


@dataclass
class ShardGroup:
    """One parameter group of a ZeroOptimizer as this rank holds it (``opt.groups[gi]``).

    ``params``: the model's parameters of the group, in order; ``layout``: which elements of them
    each rank owns (a ``ShardLayout``); ``master``: this rank's fp32 shard of the flattened group,
    ``layout.local_numel`` elements, the element of ``layout.segments(rank)`` at ``local`` holding
    parameter ``param``'s element ``start``; ``dtype``: the model weights' dtype. The wrapped
    optimizer's state for the shard is ``opt.shard_state(gi)`` / ``opt.set_shard_state(gi, state)``.
    Checkpointing (``ckpt``) reads and writes a ZeroOptimizer through these alone.
    """

    params: list[torch.Tensor]
    layout: ShardLayout
    master: torch.Tensor
    dtype: torch.dtype


class ShardAccess:
    """The shard groups and their state, re-partitioning (``layouts_for``, ``rebind``) and the
    update hooks of a ZeroOptimizer."""

    _groups: list[ShardGroup]
    _update_pre_hooks: OrderedDict[int, Callable[[Any], None]]
    _update_post_hooks: OrderedDict[int, Callable[[Any], None]]
    optimizer: torch.optim.Optimizer
    param_groups: list[dict[str, Any]]
    stage: int
    bucket_bytes: int
    comm: Any
    world_size: int
    rank: int
    _grad_comm: Any
    _reducer: GradReducer
    _scratch_bufs: dict[Any, torch.Tensor]
    _end_cycle: Callable[[], None]      # GradNorm's

    def register_update_pre_hook(self, hook: Callable[[Any], None]) -> Any:
        """Call ``hook(self)`` in ``step()`` right before the wrapped optimizer updates the shards
        (not before 1-bit Adam's compressed steps, nor when a step is skipped): each group's
        ``groups[gi].master.grad`` then holds this rank's averaged (and clipped) gradient shard
        and ``update_hyperparams()`` what the update uses. Returns a handle with ``remove()``."""
        from torch.utils.hooks import RemovableHandle

        handle = RemovableHandle(self._update_pre_hooks)
        self._update_pre_hooks[handle.id] = hook
        return handle

    def register_update_post_hook(self, hook: Callable[[Any], None]) -> Any:
        """Call ``hook(self)`` in ``step()`` right after the shards were updated (any update,
        1-bit Adam's compressed ones included; not when a step is skipped), before the weights
        are gathered. Returns a handle with ``remove()``."""
        from torch.utils.hooks import RemovableHandle

        handle = RemovableHandle(self._update_post_hooks)
        self._update_post_hooks[handle.id] = hook
        return handle

    def update_hyperparams(self) -> list[dict[str, Any]]:
        """Per group, the wrapped optimizer's hyperparameters (``lr``, ``betas``, ...; not
        ``params``) as its next update uses them (set from ``param_groups`` by ``step()``)."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def _sync_hyperparams(self) -> None:
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v

    @property
    def groups(self) -> list[ShardGroup]:
        """The per-group shards (params, layout, fp32 master shard)."""
        return self._groups

    def shard_state(self, gi: int) -> dict[str, Any]:
        """The wrapped optimizer's state for group ``gi``'s master shard (may be empty).

        Collective (call it on every rank, for the groups in the same order, as ``ckpt.save``
        does) for ``OnebitAdam`` after ``freeze_step``: the exact mean of the ranks' local
        momenta is computed for ``exp_avg``."""
        if isinstance(self.optimizer, ShardedOnebitAdam):
            return self.optimizer.saved_state(gi, self._groups[gi], self._grad_comm)
        return self.optimizer.state.get(self._groups[gi].master, {})

    def set_shard_state(self, gi: int, state: dict[str, Any]) -> None:
        """Replace the wrapped optimizer's state for group ``gi``'s master shard."""
        self.optimizer.state[self._groups[gi].master] = dict(state)
        if isinstance(self.optimizer, ShardedOnebitAdam):
            self.optimizer.restart_local()

    def layouts_for(self, world_size: int) -> list[ShardLayout]:
        """Every group's layout over ``world_size`` ranks (how ``rebind`` to a communicator of
        that size partitions it)."""
        return [ShardLayout(g.layout.numels, int(world_size), self.stage, g.layout.param_ids) for g in self._groups]

    @torch.no_grad()
    def rebind(self, comm: Any,
               local_state: list[tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]]) -> None:
        """Carry on over ``comm`` (e.g. the survivors of a failure) with this rank's new shards.

        ``local_state[gi]`` is ``(master, elementwise, other)``: this rank's fp32 master shard of
        group ``gi`` as ``layouts_for(comm.size)[gi]`` lays it out (``local_numel`` elements,
        padding included), the wrapped optimizer's per-element state laid out alike
        (name -> tensor) and its other state (name -> value, e.g. ``step``); the tensors are
        kept, not copied. Nothing is sent over the old communicator (it may hold dead ranks): its
        gradient communicator is dropped, not freed. The model's weights are left as they are.
        1-bit Adam: ``other["step"]`` is its step count, and its per-rank local momenta and
        worker errors restart as after a checkpoint load at another world size (from
        ``exp_avg``, errors at zero; see ``ShardedOnebitAdam.rebound``)."""
        import mpicomm

        if len(local_state) != len(self._groups):
            raise ValueError(f"ZeroOptimizer.rebind: expected {len(self._groups)} groups, got {len(local_state)}")
        comm = mpicomm.as_communicator(comm)
        world, rank = int(comm.size), int(comm.rank)
        new_groups: list[ShardGroup] = []
        new_states = []
        for gi, (g, layout, (master, elementwise, other)) in enumerate(
                zip(self._groups, self.layouts_for(world), local_state)):
            for name, t in [("master", master), *elementwise.items()]:
                if t.dim() != 1 or t.numel() != layout.local_numel or t.device != g.master.device:
                    raise ValueError(f"ZeroOptimizer.rebind: group {gi} {name!r}: expected a flat tensor of "
                                     f"{layout.local_numel} elements on {g.master.device} (rank {rank} of "
                                     f"{world}), got shape {tuple(t.shape)} on {t.device}")
            if master.dtype != torch.float32:
                raise TypeError(f"ZeroOptimizer.rebind: group {gi} 'master': expected float32, got {master.dtype}")
            state = dict(elementwise)
            state.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in other.items()})
            new_groups.append(ShardGroup(g.params, layout, master, g.dtype))
            new_states.append(state)
        self.optimizer.state.clear()
        for inner, g, state in zip(self.optimizer.param_groups, new_groups, new_states):
            inner["params"] = [g.master]
            if state:
                self.optimizer.state[g.master] = state
        self._groups = new_groups
        self.comm = comm
        self.world_size, self.rank = world, rank
        self._scratch_bufs.clear()
        self._grad_comm = comm.dup() if world > 1 else comm
        self._reducer = GradReducer(self._groups, self._grad_comm, self.bucket_bytes, release=self.stage == 2)
        if isinstance(self.optimizer, ShardedOnebitAdam):
            self.optimizer.rebound()
        self._end_cycle()


__all__ = ["ShardAccess", "ShardGroup"]
