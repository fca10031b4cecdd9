"""ZeRO-style optimizer: fp32 master weights and optimizer state sharded across ranks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

import mpicomm

from .layout import STAGES, ShardLayout

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class _Group:
    params: list[torch.Tensor]
    layout: ShardLayout
    master: torch.Tensor                     # this rank's fp32 shard, local_numel elements
    dtype: torch.dtype                       # the model weights' dtype in this group
    buckets: list | None = None              # see ZeroOptimizer._buckets


class ZeroOptimizer(torch.optim.Optimizer):
    """Shard fp32 master weights and the state of ``optimizer_class`` over the ranks of ``comm``.

    ``step()`` averages the model's gradients with a reduce-scatter (each rank receives the
    mean gradient of its own shard), runs the wrapped optimizer on the shard, and all-gathers
    the updated weights back into the model (cast to the model's dtype). Stage 1 shards each
    parameter group as one flat padded buffer; stage 3 splits every parameter on its own (the
    model keeps full weights on every rank either way). A parameter whose ``grad`` is None
    counts as a zero gradient. Collectives go through buffers of at most ``bucket_bytes``.
    Save and load with ``ckpt.save`` / ``ckpt.load``.
    """

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], params: Iterable[Any],
                 stage: int = 1, comm: Any = None, bucket_bytes: int = 32 << 20,
                 **optimizer_kwargs: Any) -> None:
        if stage not in STAGES:
            raise ValueError(f"ZeroOptimizer: expected stage in {STAGES}, got {stage!r}")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"ZeroOptimizer: expected a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        self.comm = mpicomm.as_communicator(comm)
        self.stage = stage
        self.optimizer_class = optimizer_class
        self.world_size = int(self.comm.size)
        self.rank = int(self.comm.rank)
        self.bucket_bytes = int(bucket_bytes)
        self._scratch_bufs: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

        groups = list(params)
        if not groups:
            raise ValueError("ZeroOptimizer: got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self._groups: list[_Group] = []
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
            self._groups.append(_Group(ps, layout, master, ps[0].dtype if ps else torch.float32))
            opts = {k: v for k, v in g.items() if k != "params"}
            inner_groups.append({"params": [master], **opts})
        self.optimizer = optimizer_class(inner_groups, **optimizer_kwargs)
        outer = []
        for grp, inner in zip(self._groups, self.optimizer.param_groups):
            outer.append({**{k: v for k, v in inner.items() if k != "params"}, "params": grp.params})
        super().__init__(outer, dict(self.optimizer.defaults))
        self._built = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_built", False):
            raise NotImplementedError("ZeroOptimizer: parameter groups are fixed at construction")
        super().add_param_group(param_group)

    # -- training -------------------------------------------------------------------------------

    def _buckets(self, g: _Group) -> list[tuple[int, int, list[tuple[int, int, int, int]]]]:
        """Column ranges [c0, c1) of the (world, local) padded buffer, at most ``bucket_bytes``
        of fp32 per range, with the pieces (rank, param, param start, column, length) in each."""
        if g.buckets is None:
            width = max(1, self.bucket_bytes // (4 * g.layout.world_size))
            out = []
            segs = g.layout.all_segments()
            for c0 in range(0, g.layout.local_numel, width):
                c1 = min(c0 + width, g.layout.local_numel)
                pieces = []
                for r, s in segs:
                    a, b = max(s.local, c0), min(s.local + s.length, c1)
                    if a < b:
                        pieces.append((r, s.param, s.start + a - s.local, a - c0, b - a))
                out.append((c0, c1, pieces))
            g.buckets = out
        return g.buckets

    def _scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._scratch_bufs.get((dtype, device))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._scratch_bufs[(dtype, device)] = buf
        return buf[:numel]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Average gradients (reduce-scatter), update the local shard, all-gather the weights."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        world = self.world_size
        for g in self._groups:
            flat = [None if p.grad is None else p.grad.reshape(-1) for p in g.params]
            grad = g.master.grad
            if grad is None:
                grad = torch.empty_like(g.master)
            for c0, c1, pieces in self._buckets(g):
                buf = self._scratch(world * (c1 - c0), torch.float32, g.master.device).view(world, c1 - c0)
                covered = sum(n for r, pi, st, col, n in pieces if flat[pi] is not None)
                if covered < buf.numel():
                    buf.zero_()
                for r, pi, st, col, n in pieces:
                    if flat[pi] is not None:
                        buf[r, col:col + n].copy_(flat[pi][st:st + n])
                self.comm.reduce_scatter_tensor(grad[c0:c1], buf.reshape(-1), op="avg")
            g.master.grad = grad
        self._sync_hyperparams()
        self.optimizer.step()
        self.gather_params()
        return loss

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather the fp32 master shards into the model weights (cast to the model dtype),
        through buffers of at most ``bucket_bytes``."""
        world = self.world_size
        for g in self._groups:
            for c0, c1, pieces in self._buckets(g):
                buf = self._scratch(world * (c1 - c0), g.dtype, g.master.device).view(world, c1 - c0)
                shard = g.master[c0:c1]
                if g.dtype != torch.float32:
                    shard = shard.to(g.dtype)
                self.comm.all_gather_into_tensor(buf.reshape(-1), shard)
                for r, pi, st, col, n in pieces:
                    g.params[pi].view(-1)[st:st + n].copy_(buf[r, col:col + n])

    def _sync_hyperparams(self) -> None:
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v

    # -- access for ckpt.save / ckpt.load -----------------------------------------------------

    @property
    def groups(self) -> list[_Group]:
        """The per-group shards (params, layout, fp32 master shard)."""
        return self._groups

    def shard_state(self, gi: int) -> dict[str, Any]:
        """The wrapped optimizer's state for group ``gi``'s master shard (may be empty)."""
        return self.optimizer.state.get(self._groups[gi].master, {})

    def set_shard_state(self, gi: int, state: dict[str, Any]) -> None:
        """Replace the wrapped optimizer's state for group ``gi``'s master shard."""
        self.optimizer.state[self._groups[gi].master] = dict(state)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        raise NotImplementedError("ZeroOptimizer holds a shard of the state; save it with ckpt.save(...)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        raise NotImplementedError("ZeroOptimizer holds a shard of the state; load it with ckpt.load(...)")

    def __repr__(self) -> str:
        return (f"ZeroOptimizer({self.optimizer_class.__name__}, stage={self.stage}, "
                f"rank={self.rank}/{self.world_size}, groups={len(self._groups)})")
