"""ZeRO-style optimizer: fp32 master weights and optimizer state sharded across ranks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from .layout import STAGES, ShardLayout

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class _Group:
    params: list[torch.Tensor]
    layout: ShardLayout
    master: torch.Tensor                     # this rank's fp32 shard, local_numel elements
    dtype: torch.dtype                       # the model weights' dtype in this group
    grad_buf: torch.Tensor | None = None     # padded full gradient, fp32, (world, local)
    weight_buf: torch.Tensor | None = None   # padded full weights, model dtype, (world, local)


def _default_comm():
    import mpicomm

    return mpicomm.init()


class ZeroOptimizer(torch.optim.Optimizer):
    """Shard fp32 master weights and the state of ``optimizer_class`` over the ranks of ``comm``.

    ``step()`` averages the model's gradients with a reduce-scatter (each rank receives the
    mean gradient of its own shard), runs the wrapped optimizer on the shard, and all-gathers
    the updated weights back into the model (cast to the model's dtype). Stage 1 shards each
    parameter group as one flat padded buffer; stage 3 splits every parameter on its own (the
    model keeps full weights on every rank either way). A parameter whose ``grad`` is None
    counts as a zero gradient. Save and load with ``ckpt.save`` / ``ckpt.load``.
    """

    def __init__(self, optimizer_class: type[torch.optim.Optimizer], params: Iterable[Any],
                 stage: int = 1, comm: Any = None, **optimizer_kwargs: Any) -> None:
        if stage not in STAGES:
            raise ValueError(f"ZeroOptimizer: expected stage in {STAGES}, got {stage!r}")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"ZeroOptimizer: expected a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        self.comm = _default_comm() if comm is None else comm
        self.stage = stage
        self.optimizer_class = optimizer_class
        self.world_size = int(self.comm.size)
        self.rank = int(self.comm.rank)

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

    # -- training -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Average gradients (reduce-scatter), update the local shard, all-gather the weights."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self._groups:
            if g.grad_buf is None:
                g.grad_buf = torch.zeros(g.layout.world_size, g.layout.local_numel,
                                         dtype=torch.float32, device=g.master.device)
            flat = [None if p.grad is None else p.grad.reshape(-1) for p in g.params]
            for r, s in g.layout.all_segments():
                dst = g.grad_buf[r, s.local:s.local + s.length]
                src = flat[s.param]
                if src is None:
                    dst.zero_()
                else:
                    dst.copy_(src[s.start:s.start + s.length])
            grad = g.master.grad
            if grad is None:
                grad = torch.empty_like(g.master)
            self.comm.reduce_scatter_tensor(grad, g.grad_buf.reshape(-1), op="avg")
            g.master.grad = grad
        self._sync_hyperparams()
        self.optimizer.step()
        self.gather_params()
        return loss

    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather the fp32 master shards into the model weights (cast to the model dtype)."""
        for g in self._groups:
            if g.weight_buf is None:
                g.weight_buf = torch.zeros(g.layout.world_size, g.layout.local_numel,
                                           dtype=g.dtype, device=g.master.device)
            shard = g.master if g.dtype == torch.float32 else g.master.to(g.dtype)
            self.comm.all_gather_into_tensor(g.weight_buf.reshape(-1), shard)
            for r, s in g.layout.all_segments():
                g.params[s.param].view(-1)[s.start:s.start + s.length].copy_(
                    g.weight_buf[r, s.local:s.local + s.length])

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
