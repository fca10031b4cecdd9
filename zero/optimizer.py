"""ZeRO-style optimizer: fp32 master weights and optimizer state sharded across ranks."""
from __future__ import annotations

import contextlib
import logging
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator

import torch

from .buckets import GradReducer
from .grad_norm import GradNorm
from .inner import check_inner, is_onebit
from .onebit import ShardedOnebitAdam
from .partition import STAGES, ShardLayout
from .quantize import check_gather_bits, dequantize, packed_bytes, quantize_into
from .shard_access import ShardAccess, ShardGroup

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
log = logging.getLogger("zero")

_STAGE3 = (
    "ZeroOptimizer: stage 3 (parameters sharded too, gathered around each module's forward and "
    "backward) is not provided; shard the model with torch.distributed.fsdp.fully_shard on "
    "dist.init_process_group('mpicomm') with a plain torch optimizer, and save it with "
    "ckpt.save(path, model=model, optimizer=opt, comm=comm). ZeroOptimizer offers stage=1 "
    "(optimizer state sharded) and stage=2 (gradients sharded too)")


class ZeroOptimizer(ShardAccess, GradNorm, torch.optim.Optimizer):
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

    Its parts: the gradient norm and clipping in ``GradNorm`` (zero.grad_norm), the shard groups,
    re-partitioning and update hooks that ckpt and elastic use in ``ShardAccess``
    (zero.shard_access); here the construction, the gradient hooks, ``step`` and the gather.
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


__all__ = ["ShardGroup", "ZeroOptimizer"]
