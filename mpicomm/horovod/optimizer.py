"""DistributedOptimizer: gradients averaged over the ranks, the allreduces overlapping the
backward pass (Horovod's semantics; the gradients go in fused buckets, in a fixed order)."""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import torch

from . import ops as _ops
from .autograd import sparse_allreduce_async
from .calls import Adasum, Average, Sum
from .compression import Compression, OnebitCompressor
from .handles import synchronize as _sync
from .process_sets import global_process_set

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
FIRST_BUCKET_BYTES = 1024 * 1024   # as DDP: the last layers' gradients start early


def _bucket_bytes() -> int:
    v = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    return int(v) if v else DEFAULT_BUCKET_BYTES


class _Bucket:
    __slots__ = ("params", "ready", "handle", "flat", "ctx", "sparse", "buf")

    def __init__(self, params):
        self.params, self.ready, self.handle, self.buf = params, 0, None, None
        self.flat = self.ctx = None
        self.sparse: list = []


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, sparse_as_dense, process_set):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        self._parameter_names = _names(self.param_groups, named_parameters)
        self._requires_update = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._allreduce_delay = {p: backward_passes_per_step for p in self._requires_update}
        self._buckets = _make_buckets(self._requires_update)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._next = 0
        self._synchronized = False
        self._should_synchronize = True
        self._onebit = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook)
                       for p in self._requires_update] if process_set.included() else []

    # -- the backward pass -------------------------------------------------------------------

    def _hook(self, p: torch.Tensor) -> None:
        if self._allreduce_delay[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step "
                                 "times before call to step(). Increase backward_passes_per_step "
                                 "to accumulate gradients locally.")
        self._allreduce_delay[p] -= 1
        if self._allreduce_delay[p] == 0:
            self._bucket_of[p].ready += 1
            self._launch_ready()
        eng = self.process_set._engine
        if eng is not None and eng.pending():
            eng.progress()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self._buckets):
            b = self._buckets[self._next]
            if not force and b.ready < len(b.params):
                return
            self._launch(b)
            self._next += 1

    def _scales(self):
        if self.op == Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _launch(self, b: _Bucket) -> None:
        dense = []
        for p in b.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse:
                b.sparse.append(p)
            else:
                dense.append(p)
        pre, post = self._scales()
        ps = self.process_set
        for p in b.sparse:
            if self.sparse_as_dense:
                h = _ops.allreduce_async(p.grad.to_dense(), None, None, self.op, pre, post, ps)
                b.ctx = b.ctx or {}
                b.ctx[p] = ("dense", h)
            else:
                b.ctx = b.ctx or {}
                b.ctx[p] = ("sparse", sparse_allreduce_async(p.grad, None, self.op, ps))
        if not dense:
            return
        numel = sum(p.grad.numel() for p in dense)
        buf = b.buf
        if buf is None or buf.numel() != numel or buf.dtype != dense[0].grad.dtype:
            buf = b.buf = torch.empty(numel, dtype=dense[0].grad.dtype, device=dense[0].grad.device)
        flat = torch.cat([p.grad.reshape(-1) for p in dense], out=buf)  # kept across steps
        if isinstance(self._compression, type) and issubclass(self._compression, OnebitCompressor):
            b.flat, b.handle = (flat, dense), "onebit"
            return
        sent, cctx = self._compression.compress(flat)
        b.flat = (sent, dense, cctx)
        b.handle = _ops.allreduce_async_(sent, None, None, self.op, pre, post, ps)

    def synchronize(self) -> None:
        """Finish every gradient allreduce of this step (forcing those not started)."""
        if not self.process_set.included():
            self._synchronized = True
            return
        self._launch_ready(force=True)
        for b in self._buckets:
            self._finish(b)
        for p in self._requires_update:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._next = 0
        self._synchronized = True

    def _finish(self, b: _Bucket) -> None:
        if b.handle == "onebit":
            flat, dense = b.flat
            flat = self._onebit_allreduce(flat, b)
            self._unflatten(flat, dense)
        elif b.handle is not None:
            sent, dense, cctx = b.flat
            _sync(b.handle)
            self._unflatten(self._compression.decompress(sent, cctx), dense)
        for p, (how, h) in (b.ctx or {}).items():
            out = h() if how == "sparse" else _sync(h).to_sparse()
            p.grad = out
        b.ready, b.handle, b.flat, b.ctx, b.sparse = 0, None, None, None, []

    def _onebit_allreduce(self, flat: torch.Tensor, b: _Bucket) -> torch.Tensor:
        import compressed  # above mpicomm: imported when used
        if self._onebit is None:
            self._onebit = compressed.OnebitAllreduce(self.process_set._comm)
        key = f"bucket{self._buckets.index(b)}"
        out = self._onebit(flat.float(), key=key)
        return out.to(flat.dtype)

    @staticmethod
    def _unflatten(flat: torch.Tensor, dense: list) -> None:
        at = 0
        for p in dense:
            n = p.grad.numel()
            p.grad.copy_(flat[at:at + n].view_as(p.grad))
            at += n

    # -- Horovod's optimizer API -------------------------------------------------------------

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside this context does not synchronize (after an explicit synchronize())."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        if any(b.handle is not None or b.ctx for b in self._buckets):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(*args, **kwargs)

    def _reset_buckets(self) -> None:
        """Forget the step in flight (after a rank failure: elastic's reset)."""
        for b in self._buckets:
            b.ready, b.handle, b.flat, b.ctx, b.sparse = 0, None, None, None, []
        self._next = 0
        self._onebit = None
        for p in self._requires_update:
            self._allreduce_delay[p] = self.backward_passes_per_step

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def load_state_dict(self, *args, **kwargs):
        super(self.__class__, self).load_state_dict(*args, **kwargs)
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step


def _names(groups, named_parameters) -> dict:
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, g in enumerate(groups)
                for j, p in enumerate(g["params"])}
    named = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(dups))
    by_param = {p: n for n, p in named}
    missing = [p for g in groups for p in g["params"] if p not in by_param]
    if missing:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         f"were not named ({len(missing)} of them). Python object ids: "
                         + ", ".join(str(id(p)) for p in missing))
    return by_param


def _make_buckets(params: list) -> list[_Bucket]:
    """Buckets of at most HOROVOD_FUSION_THRESHOLD bytes (the first at most 1 MiB, as DDP's),
    last parameters first (their gradients come first in the backward pass), one dtype and
    device per bucket."""
    cap = _bucket_bytes()
    buckets, cur, size, key = [], [], 0, None
    for p in reversed(params):
        k = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        limit = min(cap, FIRST_BUCKET_BYTES) if not buckets else cap
        if cur and (k != key or size + nbytes > limit):
            buckets.append(_Bucket(cur))
            cur, size = [], 0
        cur.append(p)
        size += nbytes
        key = k
    if cur:
        buckets.append(_Bucket(cur))
    return buckets


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,  # noqa: N802
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False,
                         process_set=global_process_set):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged (op) over the ranks of
    ``process_set``; the allreduces start during ``loss.backward()``."""
    if op == Adasum:
        raise NotImplementedError("DistributedOptimizer(op=hvd.Adasum) is not provided by "
                                  "mpicomm.horovod; use op=hvd.Average (the default) or hvd.Sum")
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer: op must be hvd.Average or hvd.Sum (got {op!r})")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1 (got {backward_passes_per_step!r})")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               op, gradient_predivide_factor, sparse_as_dense, process_set)
