"""ZeRO-style optimizer: fp32 master weights and optimizer state sharded across ranks."""
from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from .partition import STAGES, ShardLayout
from .buckets import GradReducer
from .inner import check_inner, is_onebit
from .onebit import ShardedOnebitAdam
from .quantize import check_gather_bits, dequantize, packed_bytes, quantize_into

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
log = logging.getLogger("zero")

_MODIFIED = (
    "ZeroOptimizer: the gradients of {n} parameter(s) were modified in place after backward and "
    "before step() (on ranks {ranks}). With a ZeroOptimizer each rank holds its local, unaveraged "
    "gradient until step() averages it, so torch.nn.utils.clip_grad_norm_(model.parameters(), ...) "
    "clips with a rank-local norm and torch.amp.GradScaler.unscale_ unscales rank-local gradients: "
    "both are wrong here. Clip with opt.clip_grad_norm_(max_norm) (the norm of the averaged "
    "gradient), scale the loss instead of the gradients, and call opt.zero_grad() before backward.")

_STAGE3 = (
    "ZeroOptimizer: stage 3 (parameters sharded too, gathered around each module's forward and "
    "backward) is not provided; shard the model with torch.distributed.fsdp.fully_shard on "
    "dist.init_process_group('mpicomm') with a plain torch optimizer, and save it with "
    "ckpt.save(path, model=model, optimizer=opt, comm=comm). ZeroOptimizer offers stage=1 "
    "(optimizer state sharded) and stage=2 (gradients sharded too)")


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


class ZeroOptimizer(torch.optim.Optimizer):
    """Shard fp32 master weights and the state of ``optimizer_class`` over the ranks of ``comm``.

    The model's gradients are averaged onto their shard owners in buckets of at most
    ``bucket_bytes``, launched from gradient hooks as backward produces them when ``overlap``
    (the default), so ``step()`` mostly waits. ``step()`` then runs the wrapped optimizer on the
    shard and all-gathers the weights back into the model (cast to its dtype; the model keeps
    full weights on every rank).

    ``stage=1``: the fp32 masters and the optimizer state are sharded (each parameter group one
    flat padded buffer split evenly); every rank keeps the model's full gradients until
    ``zero_grad()``. ``stage=2``: gradients are sharded too: every parameter is split on its own,
    each ``p.grad`` is set to None as soon as its bucket is sent and at most two buckets are in
    flight, so after backward a rank holds only its averaged gradient shard; each further
    backward before ``step()`` adds its averaged gradient to that shard (``no_sync()`` saves
    that communication for all micro-batches but the last, at the price of full gradients).
    Stage 3 is refused: use FSDP2.

    ``gather_bits=8`` all-gathers the weights as symmetric int8 per block of
    ``zero.quantize.BLOCK`` elements with one fp32 scale each (ZeRO++ qwZ); the owners keep
    exact fp32 masters (what a checkpoint saves), only the model's working copy is dequantized
    (error per block at most max|block| / 254).

    A parameter whose ``grad`` is None counts as a zero gradient. Under ``with opt.no_sync():``
    backward only accumulates locally (use it for all micro-batches but the last).
    ``zero_grad()`` also drops what backward already sent since the last step.
    ``clip_grad_norm_`` clips the averaged gradient; ``skip_nonfinite=True`` skips a step on
    every rank when any averaged gradient is inf/NaN (counted in ``skipped_steps``).
    ``compressed.OnebitAdam`` as ``optimizer_class`` gives 1-bit Adam on the shards. Save and
    load with ``ckpt.save`` / ``ckpt.load``.
    """

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], params: Iterable[Any],
                 stage: int = 1, comm: Any = None, bucket_bytes: int = 32 << 20, *,
                 overlap: bool = True, skip_nonfinite: bool = False, gather_bits: int | None = None,
                 **optimizer_kwargs: Any) -> None:
        import mpicomm

        if stage == 3:
            raise ValueError(_STAGE3)
        if stage not in STAGES:
            raise ValueError(f"ZeroOptimizer: expected stage in {STAGES}, got {stage!r}")
        self.gather_bits = check_gather_bits(gather_bits)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"ZeroOptimizer: expected a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        check_inner(optimizer_class)
        if int(bucket_bytes) < 1:
            raise ValueError(f"ZeroOptimizer: expected bucket_bytes >= 1, got {bucket_bytes!r}")
        self.comm = mpicomm.as_communicator(comm)
        self.stage = stage
        self.optimizer_class = optimizer_class
        self.world_size = int(self.comm.size)
        self.rank = int(self.comm.rank)
        self.bucket_bytes = int(bucket_bytes)
        self.overlap = bool(overlap)
        self.skip_nonfinite = bool(skip_nonfinite)
        self.skipped_steps = 0
        self.last_step_skipped = False
        self._scratch_bufs: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}

        groups = list(params)
        if not groups:
            raise ValueError("ZeroOptimizer: got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self._groups: list[ShardGroup] = []
        inner_groups = []
        seen: set[int] = set()
        for gi, g in enumerate(groups):
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            for p in ps:
                if id(p) in seen:
                    raise ValueError("ZeroOptimizer: a parameter appears in more than one group")
                seen.add(id(p))
                if p.dtype not in FLOAT_DTYPES:
                    raise TypeError(f"ZeroOptimizer: expected parameters of dtype {FLOAT_DTYPES}, got {p.dtype}")
            dtypes = {p.dtype for p in ps}
            devices = {p.device for p in ps}
            if len(dtypes) > 1 or len(devices) > 1:
                raise ValueError(f"ZeroOptimizer: group {gi} mixes dtypes {dtypes} or devices {devices}; "
                                 "put them in separate parameter groups")
            device = ps[0].device if ps else torch.device("cpu")
            layout = ShardLayout([p.numel() for p in ps], self.world_size, stage)
            master = torch.zeros(layout.local_numel, dtype=torch.float32, device=device)
            for s in layout.segments(self.rank):
                master[s.local:s.local + s.length].copy_(
                    ps[s.param].detach().reshape(-1)[s.start:s.start + s.length])
            self._groups.append(ShardGroup(ps, layout, master, ps[0].dtype if ps else torch.float32))
            opts = {k: v for k, v in g.items() if k != "params"}
            inner_groups.append({"params": [master], **opts})
        if is_onebit(optimizer_class):
            self.optimizer: torch.optim.Optimizer = ShardedOnebitAdam(inner_groups, **optimizer_kwargs)
        else:
            self.optimizer = optimizer_class(inner_groups, **optimizer_kwargs)
        outer = []
        for grp, inner in zip(self._groups, self.optimizer.param_groups):
            outer.append({**{k: v for k, v in inner.items() if k != "params"}, "params": grp.params})
        super().__init__(outer, dict(self.optimizer.defaults))
        # gradient traffic on a communicator of its own: buckets launched from hooks at different
        # times on different ranks can never be matched with the caller's collectives on ``comm``
        self._grad_comm = self.comm.dup() if self.world_size > 1 else self.comm
        self._reducer = GradReducer(self._groups, self._grad_comm, self.bucket_bytes, release=stage == 2)
        self._accumulating = False
        self._seen: dict[tuple[int, int], tuple[Any, int]] = {}   # grad (weak) and its version at hook time
        self._synced: tuple[float, float] | None = None                     # (norm_type, norm) once reduced
        self._finite: bool | None = None                                    # all averaged gradients finite
        self._hooks = []
        self._update_pre_hooks: OrderedDict[int, Callable[["ZeroOptimizer"], None]] = OrderedDict()
        self._update_post_hooks: OrderedDict[int, Callable[["ZeroOptimizer"], None]] = OrderedDict()
        me = weakref.ref(self)
        for gi, g in enumerate(self._groups):
            for pi, p in enumerate(g.params):
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(_make_hook(me, gi, pi)))
        self._built = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_built", False):
            raise NotImplementedError("ZeroOptimizer: parameter groups are fixed at construction")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the model's gradients and what backward already sent of them since the last step."""
        self._end_cycle()
        super().zero_grad(set_to_none)

    def close(self) -> None:
        """Remove the gradient hooks and release the gradient communicator (collective)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._reducer.drain()
        if self._grad_comm is not self.comm:
            self._grad_comm.free()
            self._grad_comm = self.comm

    # -- gradient hooks and accumulation --------------------------------------------------------

    def _on_grad(self, gi: int, pi: int, p: torch.Tensor) -> None:
        if p.grad is not None:     # a weak reference: released or dropped gradients are freed
            self._seen[(gi, pi)] = (weakref.ref(p.grad), p.grad._version)
        if self._accumulating or not self._averages_grads():
            return
        self._synced = None
        self._finite = None
        self._reducer.mark_ready(gi, pi, launch=self.overlap)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this block backward only accumulates gradients locally (no communication)."""
        prev, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = prev

    def _averages_grads(self) -> bool:
        return not (isinstance(self.optimizer, ShardedOnebitAdam) and self.optimizer.frozen)

    # -- the one small allreduce per step ---------------------------------------------------------

    def _local_power(self, norm_type: float) -> tuple[float, bool]:
        grads = ([g.master.grad for g in self._groups if g.master.grad is not None]
                 if self._averages_grads() else
                 [p.grad for g in self._groups for p in g.params if p.grad is not None])
        acc, finite = 0.0, True
        for t in grads:
            if t.numel() == 0:
                continue
            t = t.detach().float()
            if math.isinf(norm_type):
                v = float(t.abs().max())
                acc = max(acc, v)
            else:
                v = float(torch.linalg.vector_norm(t, norm_type, dtype=torch.float64) ** norm_type)
                acc += v
            finite = finite and math.isfinite(v)
        return acc, finite

    def _modified(self) -> int:
        n = 0
        for (gi, pi), (ref, version) in self._seen.items():
            if (gi, pi) in self._reducer.released:
                continue
            p, t = self._groups[gi].params[pi], ref()
            if p.grad is not t or (t is not None and t._version != version):
                n += 1
        return n

    def _sync(self, norm_type: float) -> tuple[float, bool]:
        """Reduce the gradients (if not yet), then agree over all ranks, in one small allreduce, on
        the gradient norm, non-finite values and modified gradients; return (norm, finite)."""
        if self._synced is not None and self._synced[0] == norm_type:
            return self._synced[1], bool(self._finite)
        averaging = self._averages_grads()
        for attempt in range(2):
            modified = self._modified()      # before finish() releases (stage 2) what it sends
            if averaging:
                self._reducer.finish()
            acc, finite = self._local_power(norm_type)
            stale = self._reducer.stale if averaging else False
            by_max = math.isinf(norm_type)
            # [norm power, non-finite, modified count, stale, which ranks modified (bit mask)]
            vec = torch.tensor([acc if finite else math.inf, float(not finite), float(modified), float(stale),
                                float(modified > 0) * (1.0 if by_max else 2.0 ** min(self.rank, 52))],
                               dtype=torch.float64)
            if self.world_size > 1:
                self.comm.all_reduce(vec, op="max" if by_max else "sum")
            if vec[2] > 0:
                self._end_cycle()
                ranks = "unknown (inf norm)" if by_max else \
                    [r for r in range(min(self.world_size, 53)) if int(vec[4]) >> r & 1]
                raise RuntimeError(_MODIFIED.format(n=int(vec[2]), ranks=ranks))
            if vec[3] > 0 and self._reducer.release:
                # a backward sent gradients before the one before it ended its round (it raised
                # midway): what was released cannot be sent again
                self._end_cycle()
                raise RuntimeError("ZeroOptimizer(stage=2): a backward sent gradients before the previous "
                                   "backward had finished (did it raise?); the gradients of this step are "
                                   "lost: call opt.zero_grad() and run the step's backward passes again")
            if vec[3] > 0 and attempt == 0:
                # a bucket's gradient grew after it was sent (backward again without no_sync):
                # every rank sends all buckets again, now that all gradients are final
                self._reducer.reset()
                continue
            break
        finite = bool(vec[1] == 0)
        norm = float(vec[0]) if by_max else float(vec[0]) ** (1.0 / norm_type)
        if not finite:
            norm = math.nan
        self._synced = (norm_type, norm)
        self._finite = finite
        return norm, finite

    # -- clipping --------------------------------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the averaged gradient (all parameters, all ranks) to ``max_norm``; return its norm.

        Collective. Like ``torch.nn.utils.clip_grad_norm_`` on the averaged gradient: the norm is
        taken over all parameters together (``inf``: the largest magnitude) and the shards are
        scaled by ``max_norm / (norm + 1e-6)`` when that is below 1, before ``step()`` (left
        as they are when the norm is not finite: see ``skip_nonfinite``).
        """
        norm_type = float(norm_type)
        if not (norm_type > 0):
            raise ValueError(f"clip_grad_norm_: expected norm_type > 0 or inf, got {norm_type}")
        if not self._averages_grads():
            raise RuntimeError("clip_grad_norm_: after freeze_step 1-bit Adam averages compressed momenta, "
                               "not gradients; there is no averaged gradient to clip")
        norm, finite = self._sync(norm_type)
        if not finite and error_if_nonfinite:
            raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the averaged "
                               "gradients is non-finite; set error_if_nonfinite=False to clip anyway")
        coef = float(max_norm) / (norm + 1e-6) if finite else 1.0   # non-finite: left as they are
        if coef < 1.0:
            for g in self._groups:
                if g.master.grad is not None:
                    g.master.grad.mul_(coef)
            self._synced = None
        return torch.tensor(norm, dtype=torch.float32)

    # -- training -------------------------------------------------------------------------------

    def _scratch(self, numel: int, dtype: torch.dtype, device: torch.device, slot: int = 0) -> torch.Tensor:
        buf = self._scratch_bufs.get((dtype, device, slot))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._scratch_bufs[(dtype, device, slot)] = buf
        return buf[:numel]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finish averaging the gradients, update the local shard, all-gather the weights."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._finite is None:
            self._sync(2.0)
        finite = bool(self._finite)
        self._end_cycle()
        self.last_step_skipped = self.skip_nonfinite and not finite
        if self.last_step_skipped:
            self.skipped_steps += 1
            if self.rank == 0:
                log.warning("ZeroOptimizer: step skipped on every rank, non-finite gradient "
                            "(%d skipped so far)", self.skipped_steps)
            return loss
        self._sync_hyperparams()
        if isinstance(self.optimizer, ShardedOnebitAdam) and self.optimizer.frozen:
            self.optimizer.frozen_step(self._groups, self._grad_comm)
        else:
            for hook in list(self._update_pre_hooks.values()):
                hook(self)
            self.optimizer.step()
        for hook in list(self._update_post_hooks.values()):
            hook(self)
        self.gather_params()
        return loss

    def _end_cycle(self) -> None:
        self._synced = None
        self._finite = None
        self._seen.clear()
        self._reducer.reset()

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather the fp32 master shards into the model weights (cast to the model dtype, or
        int8 per block with ``gather_bits=8``), bucket by bucket (collective)."""
        world = self.world_size
        for b in self._reducer.buckets:
            g = self._groups[b.group]
            n = b.hi - b.lo
            shard = g.master[b.lo:b.hi]
            if self.gather_bits == 8:
                w = packed_bytes(n)
                row = self._scratch(w, torch.uint8, shard.device)
                quantize_into(shard, row)
                packed = self._scratch(world * w, torch.uint8, shard.device, slot=1).view(world, w)
                self._grad_comm.all_gather_into_tensor(packed.reshape(-1), row)
                buf = dequantize(packed, n)
            else:
                buf = self._scratch(world * n, g.dtype, shard.device).view(world, n)
                self._grad_comm.all_gather_into_tensor(buf.reshape(-1), shard if g.dtype == torch.float32
                                                       else shard.to(g.dtype))
            for r, pi, st, col, k in b.pieces:
                g.params[pi].view(-1)[st:st + k].copy_(buf[r, col:col + k])

    def register_update_pre_hook(self, hook: Callable[["ZeroOptimizer"], None]) -> Any:
        """Call ``hook(self)`` in ``step()`` right before the wrapped optimizer updates the shards
        (not before 1-bit Adam's compressed steps, nor when a step is skipped): each group's
        ``groups[gi].master.grad`` then holds this rank's averaged (and clipped) gradient shard
        and ``update_hyperparams()`` what the update uses. Returns a handle with ``remove()``."""
        from torch.utils.hooks import RemovableHandle

        handle = RemovableHandle(self._update_pre_hooks)
        self._update_pre_hooks[handle.id] = hook
        return handle

    def register_update_post_hook(self, hook: Callable[["ZeroOptimizer"], None]) -> Any:
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

    # -- access for ckpt.save / ckpt.load -----------------------------------------------------

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

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        raise NotImplementedError("ZeroOptimizer holds a shard of the state; save it with ckpt.save(...)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        raise NotImplementedError("ZeroOptimizer holds a shard of the state; load it with ckpt.load(...)")

    def __repr__(self) -> str:
        bits = "" if self.gather_bits is None else f", gather_bits={self.gather_bits}"
        return (f"ZeroOptimizer({self.optimizer_class.__name__}, stage={self.stage}{bits}, "
                f"rank={self.rank}/{self.world_size}, groups={len(self._groups)})")


def _make_hook(me: "weakref.ref[ZeroOptimizer]", gi: int, pi: int) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        opt = me()
        if opt is not None:
            opt._on_grad(gi, pi, p)
    return hook


__all__ = ["ZeroOptimizer"]
