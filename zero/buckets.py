"""Bucket planning for a ZeroOptimizer (once, for both directions), and the gradient reduction.

A bucket is a column range [lo, hi) of a group's (world, local) padded layout: row r of it goes to
rank r. ``plan_buckets`` cuts each group into buckets of at most ``bucket_bytes`` of fp32 per
column range: in a per-parameter layout (stage 2) at parameter boundaries (a bucket holds whole
parameters, unless one parameter alone is wider); in the flat layout (stage 1) every ``width``
columns, each bucket touching ``world`` stretches of the flat group. Buckets are planned from
the last parameter (the highest columns) to the first, the order backward produces gradients
in. ``GradReducer`` reduce-scatters the gradients onto their owners bucket by bucket, always in
that fixed order, so every rank issues the same collectives in the same order whatever order
its gradients become ready in; ``ZeroOptimizer.gather_params`` all-gathers the weights back
through the same buckets. A bucket's fp32 send buffer exists only while it is in flight.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from .partition import ceil_div


@dataclass
class Bucket:
    """Columns [lo, hi) of group ``group``; ``pieces`` (rank, param, param start, column - lo, n)."""

    group: int
    params: tuple[int, ...]
    lo: int
    hi: int
    pieces: list[tuple[int, int, int, int, int]]
    launched: bool = False


def plan_buckets(gi: int, layout: Any, bucket_bytes: int) -> list[Bucket]:
    """Buckets of group ``gi`` (its ``ShardLayout``), from the highest columns down, each at most
    ``bucket_bytes`` of fp32 over all ranks (one column range is ``world`` elements wide)."""
    world = layout.world_size
    width = max(1, int(bucket_bytes) // (4 * world))
    if layout.per_param:
        offsets = [0]
        for n in layout.numels:
            offsets.append(offsets[-1] + ceil_div(n, world))
        cuts = [layout.local_numel]
        for pi in reversed(range(len(layout.numels))):
            if cuts[-1] - offsets[pi] > width and offsets[pi + 1] < cuts[-1]:
                cuts.append(offsets[pi + 1])
        cuts.append(0)
    else:
        cuts = list(range(layout.local_numel, 0, -width)) + [0]
    segs = layout.all_segments()
    out = []
    for hi, lo in zip(cuts, cuts[1:]):
        if lo >= hi:
            continue
        pieces = []
        for r, s in segs:
            a, z = max(s.local, lo), min(s.local + s.length, hi)
            if a < z:
                pieces.append((r, s.param, s.start + a - s.local, a - lo, z - a))
        out.append(Bucket(gi, tuple(sorted({pc[1] for pc in pieces})), lo, hi, pieces))
    return out


class GradReducer:
    """Plans buckets over ``groups`` (objects with ``params``, ``layout``, ``master``) and reduces
    the model's gradients into each group's ``master.grad`` (this rank's mean-gradient shard).

    ``release``: drop each ``p.grad`` once all of it is in a send buffer, and keep at most
    ``MAX_IN_FLIGHT`` buckets in flight (waiting for the oldest before launching another), so no
    full-size gradient is kept (stage 2). Launched from backward (``mark_ready(launch=True)``),
    each backward is then a round: at its end the buckets it left are sent too (a parameter
    without a gradient counts as zero), and a later backward in the same cycle adds its round
    to the shards (gradient accumulation without ``no_sync``)."""

    MAX_IN_FLIGHT = 2

    def __init__(self, groups: list, comm: Any, bucket_bytes: int, release: bool = False) -> None:
        self.groups = groups
        self.release = release
        self.released: set[tuple[int, int]] = set()
        self.comm = comm
        self.world = int(comm.size)
        self.rank = int(comm.rank)
        self.buckets: list[Bucket] = []
        self.where: dict[tuple[int, int], list[int]] = {}   # (group, param) -> bucket indices
        for gi in reversed(range(len(groups))):
            self.buckets += plan_buckets(gi, groups[gi].layout, bucket_bytes)
        for bi, b in enumerate(self.buckets):
            for pi in b.params:
                self.where.setdefault((b.group, pi), []).append(bi)
        self.ready: set[tuple[int, int]] = set()
        self.next = 0                                      # first bucket of this round not launched
        self.inflight: deque[_InFlight] = deque()          # launched, oldest first
        self.stale = False                                 # a launched bucket's gradient changed
        self.rounds = 0                                    # backwards whose buckets all left (release)
        self.round_open = False                            # a backward of this round is running

    # -- readiness (called from gradient hooks) ----------------------------------------------------

    def mark_ready(self, gi: int, pi: int, launch: bool) -> None:
        """Parameter ``pi`` of group ``gi`` has its gradient; launch the buckets now complete, in order."""
        if self.release and launch and not self.round_open:
            self.round_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_round)
        if any(self.buckets[bi].launched for bi in self.where.get((gi, pi), ())):
            self.stale = True              # accumulated again after its bucket left: redo in step()
            return
        self.ready.add((gi, pi))
        if launch:
            while self.next < len(self.buckets) and all(
                    (self.buckets[self.next].group, q) in self.ready for q in self.buckets[self.next].params):
                self._launch(self.buckets[self.next])
                self.next += 1
        self.poll()

    def end_round(self) -> None:
        """End of a backward (``release``): send the buckets it left, in order, and start a new
        round, which adds to the shards."""
        self.round_open = False
        while self.next < len(self.buckets):
            self._launch(self.buckets[self.next])
            self.next += 1
        for b in self.buckets:
            b.launched = False
        self.ready.clear()
        self.next = 0
        self.rounds += 1
        self.poll()

    def poll(self) -> None:
        """Let MPI progress the collectives in flight; finish (and free) the oldest ones done."""
        while self.inflight and all(w.is_completed() for w in self.inflight[0].works):
            self._finish_oldest()

    # -- launching and finishing ---------------------------------------------------------------

    def _launch(self, b: Bucket) -> None:
        if self.release:
            while len(self.inflight) >= self.MAX_IN_FLIGHT:
                self._finish_oldest()
        params = self.groups[b.group].params
        cols = b.hi - b.lo
        dev = self.groups[b.group].master.device
        buf = torch.zeros(self.world, cols, dtype=torch.float32, device=dev)
        flat = {pi: (None if params[pi].grad is None else params[pi].grad.detach().reshape(-1)) for pi in b.params}
        for r, pi, st, col, n in b.pieces:
            g = flat[pi]
            if g is not None:
                buf[r, col:col + n].copy_(g[st:st + n])
        out = self._master_grad(b.group)[b.lo:b.hi]
        into = torch.empty_like(out) if self.rounds else out   # a later round adds to the shard
        works = [self.comm.reduce_scatter_tensor(into, buf.view(-1), op="avg", async_op=True)]
        self.inflight.append(_InFlight(works, buf, out if self.rounds else None, into))
        b.launched = True
        if self.release:
            for pi in b.params:
                if all(self.buckets[bj].launched for bj in self.where[(b.group, pi)]):
                    params[pi].grad = None
                    self.released.add((b.group, pi))

    def _master_grad(self, gi: int) -> torch.Tensor:
        m = self.groups[gi].master
        if m.grad is None:
            m.grad = torch.zeros_like(m)
        return m.grad

    def _finish_oldest(self, use: bool = True) -> None:
        f = self.inflight.popleft()
        for wk in f.works:
            wk.wait()
        if use and f.add_to is not None:
            f.add_to.add_(f.result)

    def finish(self) -> None:
        """Launch the buckets not launched yet (in order; none when the last backward's round
        sent them all), wait for all, fill ``master.grad``."""
        if not (self.rounds and self.next == 0 and not self.ready):
            while self.next < len(self.buckets):
                self._launch(self.buckets[self.next])
                self.next += 1
        while self.inflight:
            self._finish_oldest()

    def drain(self) -> None:
        """Wait for anything in flight and forget it (its result is not used)."""
        while self.inflight:
            self._finish_oldest(use=False)

    def reset(self) -> None:
        """Start a new accumulation cycle: nothing ready, nothing launched."""
        self.drain()
        for b in self.buckets:
            b.launched = False
        self.ready.clear()
        self.released.clear()
        self.next = 0
        self.stale = False
        self.rounds = 0
        self.round_open = False


@dataclass
class _InFlight:
    """A launched bucket: its reduce-scatter, send buffer, and (a later round) the shard slice
    its result is added to."""

    works: list[Any]
    buf: torch.Tensor
    add_to: torch.Tensor | None
    result: torch.Tensor
