"""Hierarchical 1-bit allreduce: full precision inside each node, 1-bit only across nodes.

On a communicator of ``N`` nodes with ``L`` ranks each (nodes from the communicator's
shared-memory split, ``MPI_COMM_TYPE_SHARED``, never from host names), a call on ``n``
elements pads them to ``padded = padded_size(n, N * L)`` (as the flat algorithm does) and cuts
them in ``L`` parts of ``sub = padded / L`` elements. The rank of local index ``j`` (its rank
among its node's ranks, in communicator order):

1. reduce-scatter inside the node, in float32 (shared memory): part ``j`` of the node's mean
   (each rank sends the others their parts and reads its own in place; summed over the node's
   ranks in rank order, divided by L; with ``OnebitAllreduce``'s host kernels the last add and
   the divide happen inside step 2's packing pass, so the mean is never written to memory);
2. runs the flat 1-bit allreduce (``engine``) on that part with the ranks of local index ``j``
   on the other nodes (one per node): worker error feedback on ``x = node mean part + worker
   error``, server error feedback on its ``sub / N`` chunk, as DeepSpeed's algorithm among N
   ranks, up to the decode: its result stays encoded (server signs and scales);
3. all-gathers the ``L`` encoded results inside the node (1/32 of the float32 parts) and
   decodes all of them, so every rank of the node writes the whole output itself.

The result is the mean over all ranks, compressed once across nodes. Error feedback belongs to
step 2: the worker error buffer (``padded`` elements, as for the flat algorithm) holds the error
of this rank's part in its first ``sub`` elements; the rest stays as it was (zeros) and unused.
The server error (``padded / (N * L)`` elements) has exactly the flat algorithm's size. Per call,
bytes that leave a node are ``2 (N - 1) / N * padded / 8`` over all its ranks together instead
of about ``L`` times that.

When: ``hierarchical=None`` (the default) takes it when there are several nodes with the same
number ``L > 1`` of ranks each, else the flat algorithm (one node, one rank per node, or uneven
nodes). ``hierarchical=True`` refuses (``ValueError`` on every rank) a communicator that is not
so; ``False`` always runs flat.

For tests and simulation only: ``MPICOMM_NODE_SIZE=k`` (same value on every rank) makes nodes
of ``k`` consecutive communicator ranks instead of asking MPI, so a single machine can stand
for several nodes. Never set it on a real cluster.
"""
from __future__ import annotations

import os

import numpy as np

import mpicomm

from . import engine
from .errors import NonFiniteError, SizeMismatchError
from .wire_format import P2_TRAILER, Layout

__all__ = ["NODE_SIZE_ENV", "Hierarchy", "decide", "part_size"]

#: Test/simulation override: nodes of this many consecutive communicator ranks.
NODE_SIZE_ENV = "MPICOMM_NODE_SIZE"


def decide(counts: list[int], hierarchical: bool | None) -> bool:
    """Whether to run hierarchically on nodes of ``counts`` ranks (in node order); raises
    ``ValueError`` for ``hierarchical=True`` on a communicator that cannot (pure logic)."""
    if hierarchical is False:
        return False
    nodes, uniform = len(counts), len(set(counts)) == 1
    if hierarchical is None:
        return nodes > 1 and uniform and counts[0] > 1
    if nodes < 2 or not uniform or counts[0] < 2:
        raise ValueError(
            f"compressed allreduce: hierarchical=True needs several nodes with the same number "
            f"(> 1) of ranks each; this communicator has {nodes} node(s) with {counts} ranks. "
            f"Use hierarchical=None (falls back to the flat algorithm here) or False.")
    return True


def part_size(numel: int, world_size: int, per_node: int) -> int:
    """Elements of each rank's part (``padded_size(numel, world_size) / per_node``)."""
    return Layout(numel, world_size).padded // per_node


def _node_first(comm: mpicomm.Communicator) -> int:
    """The first communicator rank on this rank's node (collective)."""
    forced = os.environ.get(NODE_SIZE_ENV, "").strip()
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"{NODE_SIZE_ENV}: expected a positive number of ranks, got {forced!r}")
        return comm.rank - comm.rank % int(forced)
    node = comm.split_node()
    try:
        first = np.array([comm.rank], np.int64)
        node.all_reduce(first, op="min")
        return int(first[0])
    finally:
        node.free()


class Hierarchy:
    """Node structure of a communicator and, when hierarchical, its node and cross-node
    communicators. Collective over ``comm``; every rank reaches the same decision."""

    def __init__(self, comm: mpicomm.Communicator, hierarchical: bool | None,
                 max_pieces: int | None = None) -> None:
        self.enabled = False
        self.parent = comm
        self.max_pieces = max_pieces
        self.node: mpicomm.Communicator | None = None
        self.cross: mpicomm.Communicator | None = None
        self.nodes, self.per_node, self.local_index, self.node_index = 1, comm.size, comm.rank, 0
        self.positions: list[tuple[int, int]] = []  # hierarchical, per rank: see layout_record
        if hierarchical is False:
            return
        forced = bool(os.environ.get(NODE_SIZE_ENV, "").strip())
        if not hasattr(comm, "split_node"):  # not an mpicomm Communicator: no node structure
            decide([comm.size], hierarchical)
            return
        if hierarchical is None and not forced and comm.local_size == comm.size:
            return  # one node: every rank sees local_size == size, no collective needed
        rank = comm.rank
        first = _node_first(comm)
        everyone = np.empty(comm.size, np.int64)
        comm.all_gather_into_tensor(everyone, np.array([first], np.int64))
        firsts = everyone.tolist()
        order = sorted(set(firsts))
        counts = [firsts.count(f) for f in order]
        if not decide(counts, hierarchical):
            return
        self.enabled = True
        self.nodes, self.per_node = len(order), counts[0]
        local = [firsts[:r].count(f) for r, f in enumerate(firsts)]
        # (rank in its cross-node group, local index): which chunk of which part it serves
        self.positions = [(local[:r].count(j), j) for r, j in enumerate(local)]
        self.node_index, self.local_index = order.index(first), local[rank]
        self.node = comm.split(self.node_index, rank)
        self.cross = comm.split(self.local_index, rank)

    def layout_record(self):
        """The layout for ``compressed.reshard``: None (flat) or (nodes, per_node, positions),
        ``positions[r]`` = (rank r's rank in its cross-node group, which orders the server
        chunks, and its local index, which names its part)."""
        return (self.nodes, self.per_node, self.positions) if self.enabled else None

    def describe(self) -> str:
        """'flat' or 'hierarchical: N nodes x L ranks'."""
        if not self.enabled:
            return "flat"
        return f"hierarchical: {self.nodes} nodes x {self.per_node} ranks"

    def layout(self, numel: int) -> Layout:
        """The cross-node layout of this rank's part of a call on ``numel`` elements."""
        return Layout(part_size(numel, self.nodes * self.per_node, self.per_node), self.nodes,
                      self.max_pieces)

    def wire_bytes(self, numel: int) -> tuple[int, int]:
        """(bytes this rank sends to other nodes, bytes to ranks of its node) per call."""
        L = self.per_node
        lay = self.layout(numel)
        gathered = lay.world_size * (lay.chunk_bytes + P2_TRAILER)
        return lay.wire_bytes(), (L - 1) * (4 * lay.numel + gathered)

    # ------------------------------------------------------------------------------------------
    def _node_mean_part(self, fam, src, part, recv, lazy: bool):
        """This rank's part of the mean over the node of ``src`` (padded elements): each rank
        sends every other rank of its node that rank's part and keeps its own (read from
        ``src``, never copied); the parts are added in rank order and divided by L. Returns
        ``part`` holding it, or with ``lazy`` (host kernels, deferred errors) a
        ``families.NodeMean`` whose last add and divide the packing pass does (64 MiB, 2 ranks
        per node: one pass over 32 MiB fewer, 8.4 ms against 11.4 ms for the mean then the pack
        on one core). (MPICH's reduce-scatter took 197 ms on 64 MiB and 2 ranks here, an
        all-to-all + add 66 ms; the all-to-all also copied each rank's own part.)"""
        L, k, j = self.per_node, part.shape[0], self.local_index
        peers = [(j + d) % L for d in range(1, L)]  # staggered: not every rank to rank 0 first
        works = [self.node.irecv(recv[r * k:(r + 1) * k], r) for r in peers]
        works += [self.node.isend(src[r * k:(r + 1) * k], r) for r in peers]
        for w in works:
            w.wait()
        if lazy:
            return fam.lazy_node_mean(src, recv, j, L, part)
        fam.node_mean(src, recv, j, L, part)
        return part

    def _agree(self, local: Exception | None) -> Exception | None:
        """Collective over the node: the error to raise when any rank of the node has one."""
        code = np.array([0 if local is None else 2 if isinstance(local, SizeMismatchError) else 1],
                        np.int64)
        codes = np.empty(self.per_node, np.int64)
        self.node.all_gather_into_tensor(codes, code)
        if local is not None or not codes.any():
            return local
        which = [j for j, c in enumerate(codes.tolist()) if c]
        if 2 in codes.tolist():
            return SizeMismatchError(
                f"compressed allreduce (hierarchical): the ranks passed different sizes (found by "
                f"the ranks of local index {which} on this node); expected the same size on every "
                f"rank. No buffer was modified.")
        return NonFiniteError(
            f"compressed allreduce (hierarchical): the input (plus worker error) is not finite "
            f"(inf or NaN) on some rank (found by the ranks of local index {which} on this node); "
            f"expected finite values everywhere. No buffer was modified.")

    def allreduce(self, fam, numel: int, g, out, e, s, ws: engine.Workspace, scratch,
                  deferred: engine.Deferred | None = None) -> tuple[float, float]:
        """The hierarchical call (module doc): ``g``/``out`` of ``numel`` elements (may alias),
        ``e`` (padded), ``s`` (chunk) flat float32 arrays of ``fam``'s kind; ``scratch(name, k)``
        gives kept float32 buffers. Returns this rank's (worker, server) scales. A rank failure
        (ULFM) raises RankFailedError naming the ranks of the whole communicator (the node and
        cross-node communicators are revoked with it: no rank waits in a later phase)."""
        try:
            return self._allreduce(fam, numel, g, out, e, s, ws, scratch, deferred)
        except mpicomm.RankFailedError as exc:
            parent = self.parent
            ranks = parent.failed_ranks() if parent.fault_tolerant else exc.failed_ranks
            raise mpicomm.RankFailedError(
                f"compressed allreduce (hierarchical) on {parent!r}: "
                f"{'ranks ' + ', '.join(map(str, ranks)) + ' failed' if ranks else 'a peer revoked it'}"
                f" (seen on its node or cross-node communicator: {exc})", ranks,
                exc.error_class) from exc

    def _allreduce(self, fam, numel, g, out, e, s, ws, scratch, deferred):
        L = self.per_node
        lay = self.layout(numel)
        sub, padded = lay.numel, lay.numel * L
        sizes = np.empty(L, np.int64)
        self.node.all_gather_into_tensor(sizes, np.array([numel], np.int64))
        pre: Exception | None = None
        tag = None
        if (sizes != numel).any():
            pre = SizeMismatchError(
                f"compressed allreduce: the ranks of a node passed different sizes (elements per "
                f"rank: {sizes.tolist()}); expected the same size on every rank. No buffer was "
                f"modified.")
            numel = int(sizes[0])  # one layout for the node's ranks; the peers learn from the tag
            lay = self.layout(numel)
            sub, padded = lay.numel, lay.numel * L
            tag = numel + 1
        part = scratch("hier_part", sub)
        if pre is None:
            if numel == padded:
                src = g
            else:
                src = scratch("hier_in", padded)
                src[:numel] = g
                src[numel:] = 0
            # deferred errors read the mean once (the pack); DeepSpeed's in-place update reads
            # it again after the scale is known, so there it is written out
            lazy = deferred is not None and fam.fuses_node_mean
            mean = self._node_mean_part(fam, src, part, scratch("hier_recv", padded), lazy)
        else:
            part[:] = 0
            mean = part
        d = None
        if deferred is not None:
            d = engine.Deferred(deferred.xout[:sub], deferred.worker_pending, deferred.server_pending)
        scales = engine.allreduce(self.cross, fam, lay, mean, None, e[:sub], s, ws, d, size_tag=tag,
                                  agree=lambda err: self._agree(err if err is not None else pre))
        self._node_decode(fam, lay, ws, out, numel)
        return scales

    def _node_decode(self, fam, lay: Layout, ws: engine.Workspace, out, numel: int) -> None:
        """All-gather inside the node the encoded results (``ws.grecv``: server signs and
        scales, 1/32 of the float32 parts) and decode every part into ``out``: each rank decodes
        the same bytes, and decoding is exact (+-scale), so all hold the same result. (netsim,
        2 hosts x 2 ranks, 1 Gbit/s, 64 MiB: hier/flat 1.00-1.09x, against 1.21-1.24x when the
        decoded float32 parts were all-gathered.)"""
        L, sub = self.per_node, lay.numel
        n = ws.grecv.shape[0]
        every = ws.scratch.get("hier_grecv")
        if every is None or every.shape[0] != L * n:
            every = ws.scratch["hier_grecv"] = ws.grecv.new_empty(L * n)
        self.node.all_gather_into_tensor(every, ws.grecv)
        for j in range(L):
            lo, hi = j * sub, min((j + 1) * sub, numel)
            if lo < hi:
                engine.decode(fam, lay, every[j * n:(j + 1) * n], out[lo:hi])
