"""Gradient buckets of a ZeroOptimizer, reduced onto their shard owners with non-blocking collectives.

Buckets hold consecutive parameters of one group, planned from the last parameter to the first
(the order backward produces gradients) and always launched in that fixed order, so every rank
issues the same collectives in the same order whatever order its gradients become ready in.
Stage 3 buckets are column ranges of the (world, local) padded layout, reduce-scattered; stage 1
buckets are ranges of the flat group, reduced (``reduce`` with the owner as root) piece by owner.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .layout import ceil_div


@dataclass
class Bucket:
    """One bucket: parameters ``params`` (indices in group ``group``) and its fp32 send buffer."""

    group: int
    params: tuple[int, ...]
    buf: torch.Tensor
    lo: int                                  # stage 3: first column; stage 1: first flat element
    hi: int
    places: list[tuple[int, int, int]]       # (param, numel, column or flat offset - lo)
    works: list[Any] = field(default_factory=list)
    launched: bool = False


class GradReducer:
    """Plans buckets over ``groups`` (objects with ``params``, ``layout``, ``master``) and reduces
    the model's gradients into each group's ``master.grad`` (this rank's mean-gradient shard)."""

    def __init__(self, groups: list, comm: Any, stage: int, bucket_bytes: int) -> None:
        self.groups = groups
        self.comm = comm
        self.world = int(comm.size)
        self.rank = int(comm.rank)
        self.stage = stage
        self.buckets: list[Bucket] = []
        self.where: dict[tuple[int, int], int] = {}      # (group, param) -> bucket index
        for gi in reversed(range(len(groups))):
            self._plan(gi, groups[gi], max(1, int(bucket_bytes) // 4))
        for bi, b in enumerate(self.buckets):
            for pi in b.params:
                self.where[(b.group, pi)] = bi
        self.ready: set[tuple[int, int]] = set()
        self.next = 0                                      # first bucket not launched yet
        self.stale = False                                 # a launched bucket's gradient changed

    def _plan(self, gi: int, g: Any, limit: int) -> None:
        numels = [p.numel() for p in g.params]
        if self.stage == 3:
            cost = [ceil_div(n, self.world) * self.world for n in numels]
            offsets = [0]
            for n in numels:
                offsets.append(offsets[-1] + ceil_div(n, self.world))
        else:
            cost = list(numels)
            offsets = [0]
            for n in numels:
                offsets.append(offsets[-1] + n)
        run: list[int] = []
        size = 0
        for pi in reversed(range(len(numels))):
            if run and size + cost[pi] > limit:
                self._add(gi, sorted(run), offsets, numels)
                run, size = [], 0
            run.append(pi)
            size += cost[pi]
        if run:
            self._add(gi, sorted(run), offsets, numels)

    def _add(self, gi: int, params: list[int], offsets: list[int], numels: list[int]) -> None:
        lo, hi = offsets[params[0]], offsets[params[-1] + 1]
        n = (hi - lo) * (self.world if self.stage == 3 else 1)
        device = self.groups[gi].master.device
        places = [(pi, numels[pi], offsets[pi] - lo) for pi in params]
        self.buckets.append(Bucket(gi, tuple(params), torch.zeros(n, dtype=torch.float32, device=device),
                                   lo, hi, places))

    # -- readiness (called from gradient hooks) ----------------------------------------------------

    def mark_ready(self, gi: int, pi: int, launch: bool) -> None:
        """Parameter ``pi`` of group ``gi`` has its gradient; launch the buckets now complete, in order."""
        bi = self.where[(gi, pi)]
        if self.buckets[bi].launched:
            self.stale = True              # accumulated again after its bucket left: redo in step()
            return
        self.ready.add((gi, pi))
        if launch:
            while self.next < len(self.buckets) and all(
                    (self.buckets[self.next].group, q) in self.ready for q in self.buckets[self.next].params):
                self._launch(self.buckets[self.next])
                self.next += 1
        self.poll()

    def poll(self) -> None:
        """Let MPI progress the collectives in flight (MPI progresses them inside MPI calls)."""
        for b in self.buckets[:self.next]:
            for w in b.works:
                if not w.is_completed():
                    return

    # -- launching and finishing ---------------------------------------------------------------

    def _launch(self, b: Bucket) -> None:
        params = self.groups[b.group].params
        w = self.world
        if self.stage == 3:
            cols = b.hi - b.lo
            rows = b.buf.view(w, cols)
            for pi, n, col in b.places:
                piece = ceil_div(n, w)
                dst = rows[:, col:col + piece]
                grad = params[pi].grad
                if grad is None:
                    dst.zero_()
                    continue
                g = grad.detach().reshape(-1)
                full = n // piece if piece else 0
                if full:
                    dst[:full].copy_(g[:full * piece].view(full, piece))
                if full < w:
                    rest = n - full * piece
                    dst[full, :rest].copy_(g[full * piece:])
                    dst[full, rest:].zero_()
                    dst[full + 1:].zero_()
            out = self._master_grad(b.group)[b.lo:b.hi]
            b.works = [self.comm.reduce_scatter_tensor(out, b.buf, op="avg", async_op=True)]
        else:
            for pi, n, off in b.places:
                grad = params[pi].grad
                if grad is None:
                    b.buf[off:off + n].zero_()
                else:
                    b.buf[off:off + n].copy_(grad.detach().reshape(-1))
            local = self.groups[b.group].layout.local_numel
            works = []
            for r in range(w):
                a, z = max(b.lo, r * local), min(b.hi, (r + 1) * local)
                if a < z:
                    works.append(self.comm.reduce(b.buf[a - b.lo:z - b.lo], dst=r, op="avg", async_op=True))
            b.works = works
        b.launched = True

    def _master_grad(self, gi: int) -> torch.Tensor:
        m = self.groups[gi].master
        if m.grad is None:
            m.grad = torch.zeros_like(m)   # padding stays zero: no bucket writes it
        return m.grad

    def finish(self) -> None:
        """Launch the buckets not launched yet (in order), wait for all, fill ``master.grad``."""
        while self.next < len(self.buckets):
            self._launch(self.buckets[self.next])
            self.next += 1
        for b in self.buckets:
            self._wait(b)

    def _wait(self, b: Bucket) -> None:
        for wk in b.works:
            wk.wait()
        if self.stage == 1 and b.works:
            local = self.groups[b.group].layout.local_numel
            a, z = max(b.lo, self.rank * local), min(b.hi, (self.rank + 1) * local)
            if a < z:
                base = self.rank * local
                self._master_grad(b.group)[a - base:z - base].copy_(b.buf[a - b.lo:z - b.lo])
        b.works = []

    def drain(self) -> None:
        """Wait for anything in flight and forget it (its result is not used)."""
        for b in self.buckets:
            for wk in b.works:
                wk.wait()
            b.works = []

    def reset(self) -> None:
        """Start a new accumulation cycle: nothing ready, nothing launched."""
        self.drain()
        for b in self.buckets:
            b.launched = False
        self.ready.clear()
        self.next = 0
        self.stale = False

    def in_flight(self) -> bool:
        """Whether some bucket has been launched in this cycle."""
        return self.next > 0
