"""The 1-bit compressed allreduce, once, for every kernel family and both public APIs.

``allreduce`` runs DeepSpeed's algorithm on mpicomm's async collectives in the wire format of
``layout``:

1. phase 1, per piece: pack the worker signs of x = input + worker error for every chunk, post
   the piece's all-to-all (blocking when there is only one piece), and pack the next piece while it travels (MPI progress between
   pieces); the last piece carries the worker scale and size, so every rank checks sizes and
   finiteness before anything is modified;
2. phase 2, per piece: combine the received signs with the server error, pack the server signs,
   post the piece's all-gather, and do the next piece (and a share of the worker error update)
   while it travels; the server scale rides on the last piece; then decode.

With ``deferred`` (``OnebitAllreduce``) the error buffers hold the previous call's x and s plus
their pending scales; the update is fused into this call's passes instead of run after it.
``reduce_scatter`` is phase 1 alone: each rank gets the mean estimate of its own chunk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .errors import NonFiniteError, SizeMismatchError
from .wire_format import P1_TRAILER, P2_TRAILER, Layout

__all__ = ["Deferred", "Workspace", "allreduce", "decode", "reduce_scatter",
           "reduce_scatter_start"]


@dataclass
class Deferred:
    """Deferred error updates: ``xout`` receives this call's x (the worker buffer is only read);
    the worker and server buffers still need ``x - pend * sign(x)`` with these pending scales."""

    xout: Any
    worker_pending: float
    server_pending: float


class Workspace:
    """Message buffers of one layout on one device (uint8 torch tensors handed to mpicomm)."""

    def __init__(self, lay: Layout, device: torch.device) -> None:
        p, cb = lay.world_size, lay.chunk_bytes
        self.send = torch.empty(p * (cb + P1_TRAILER), dtype=torch.uint8, device=device)
        self.recv = torch.empty_like(self.send)
        self.gsend = torch.empty(cb + P2_TRAILER, dtype=torch.uint8, device=device)
        self.grecv = torch.empty(p * (cb + P2_TRAILER), dtype=torch.uint8, device=device)
        self.scratch: dict[str, Any] = {}


#: Packed bytes of work (8 elements each) between two MPI progress calls.
STEP_BYTES = 1 << 15


def _steps(lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) in steps of at most STEP_BYTES bytes."""
    return [(a, min(a + STEP_BYTES, hi)) for a in range(lo, hi, STEP_BYTES)] or [(lo, hi)]


def _block(buf: torch.Tensor, p: int, lo: int, hi: int, trailer: int) -> torch.Tensor:
    """(p, hi - lo + trailer) message of piece [lo, hi) inside a buffer laid out by pieces."""
    return buf[p * lo:p * (hi + trailer)].reshape(p, hi - lo + trailer)


def _trailer(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(values.tobytes(), np.uint8).copy())


class _Pending:
    """Posted async collectives: progress between pieces; wait for all (also on error paths)."""

    def __init__(self) -> None:
        self.works: list = []

    def add(self, work) -> None:
        self.works.append(work)
        self.progress()

    def post(self, collective, out, inp, blocking: bool) -> None:
        """Run ``collective(out, inp)``: blocking when there is only one piece (nothing to
        overlap; MPI's blocking collectives are much faster than a nonblocking one and its
        wait: 2 ranks, 256 B, Allgather 2.8 us against Iallgather + Wait 255 us, loaded
        machine), else async and kept."""
        if blocking:
            collective(out, inp)
        else:
            self.add(collective(out, inp, async_op=True))

    def progress(self) -> None:
        self.works = [w for w in self.works if not w.is_completed()]

    def wait(self) -> None:
        works, self.works = self.works, []
        for w in works:
            w.wait()


def _phase1(comm, fam, lay: Layout, g, e, ws: Workspace, deferred: Deferred | None,
            pend: _Pending, size_tag: int | None = None, agree=None) -> tuple[np.ndarray, float]:
    """Send worker signs by pieces, then scale and size; return (every rank's scale, this rank's).

    ``size_tag`` replaces the size sent in the trailer (a caller that knows its input is wrong
    sends another one, so that every peer raises ``SizeMismatchError``); ``agree(error or None)``
    is called after the checks and returns the error to raise (``hierarchical`` agrees with the
    ranks of the node there). Nothing is modified before it returns."""
    scale = _phase1_send(comm, fam, lay, g, e, ws, deferred, pend, size_tag, False)
    pend.wait()
    return _phase1_check(lay, ws, agree), scale


def _phase1_send(comm, fam, lay: Layout, g, e, ws: Workspace, deferred: Deferred | None,
                 pend: _Pending, size_tag: int | None, async_op: bool) -> float:
    """Pack and post phase 1's pieces (all async with ``async_op``, else blocking when there
    is one); return this rank's worker scale. ``e`` is only read."""
    p, chunk, m = lay.world_size, lay.chunk, lay.numel
    pieces = lay.pieces()
    send, recv = fam.view(ws.send), fam.view(ws.recv)
    ssq = 0.0
    for k, (lo, hi) in enumerate(pieces):
        last = k == len(pieces) - 1
        trailer = P1_TRAILER if last else 0
        rows = _block(send, p, lo, hi, trailer)
        for j in range(p):
            for sl, sh in _steps(lo, hi):  # MPI progress between steps: earlier pieces flow
                a, b = j * chunk + 8 * sl, j * chunk + 8 * sh
                gp, out = g[min(a, m):min(b, m)], rows[j:j + 1, sl - lo:sh - lo]
                if deferred is None:
                    ssq += fam.encode(gp, e[a:b], out)
                else:
                    ssq += fam.encode(gp, e[a:b], out, deferred.xout[a:b], deferred.worker_pending)
                pend.progress()
        if last:
            scale = np.float32(math.sqrt(ssq / lay.padded))
            tail = np.zeros(2, np.uint32)
            tail[0] = np.array([scale], np.float32).view(np.uint32)[0]
            tail[1] = (m if size_tag is None else size_tag) % (1 << 32)
            msg = _block(ws.send, p, lo, hi, trailer)
            msg[:, hi - lo:] = _trailer(tail).to(msg.device).view(1, P1_TRAILER)
        pend.post(comm.all_to_all_single, _block(ws.recv, p, lo, hi, trailer),
                  _block(ws.send, p, lo, hi, trailer), len(pieces) == 1 and not async_op)
    return float(scale)


def _phase1_check(lay: Layout, ws: Workspace, agree) -> np.ndarray:
    """After phase 1 arrived: every rank's worker scale, or raise (sizes differ, not finite)."""
    p = lay.world_size
    lo, hi = lay.pieces()[-1]
    tails = _block(ws.recv, p, lo, hi, P1_TRAILER)[:, hi - lo:].cpu().contiguous().numpy()
    sizes = tails[:, 4:].copy().view(np.uint32).reshape(p)
    wscales = tails[:, :4].copy().view(np.float32).reshape(p)
    return _tails_check(lay, sizes, wscales, agree)


def _tails_check(lay: Layout, sizes: np.ndarray, wscales: np.ndarray, agree) -> np.ndarray:
    """``wscales``, or raise when the ``sizes`` the ranks sent differ or a scale is not finite."""
    p, m = lay.world_size, lay.numel
    if agree is None and (sizes == m % (1 << 32)).all() and np.isfinite(wscales).all():
        return wscales
    bad = [r for r in range(p) if not math.isfinite(float(wscales[r]))]
    err: Exception | None = None
    if (sizes != m % (1 << 32)).any():
        err = SizeMismatchError(
            f"compressed allreduce: the ranks passed different sizes (elements per rank: "
            f"{sizes.tolist()}); expected the same size on every rank. No buffer was modified.")
    elif bad:
        err = NonFiniteError(
            f"compressed allreduce: the input (plus worker error) is not finite (inf or NaN) on "
            f"rank(s) {bad} of {p}; expected finite values everywhere. No buffer was modified.")
    if agree is not None:
        err = agree(err)
    if err is not None:
        raise err
    return wscales


def allreduce(comm, fam, lay: Layout, g, out, e, s, ws: Workspace,
              deferred: Deferred | None = None, *, size_tag: int | None = None,
              agree=None) -> tuple[float, float]:
    """Write the compressed mean of every rank's ``g`` into ``out``; return (worker, server) scale.

    ``g`` (numel elements), ``out`` (numel), ``e`` (padded), ``s`` (chunk) are flat float32
    arrays of ``fam``'s kind; ``out`` may alias ``g``, or be None: the result then stays
    encoded in ``ws.grecv`` for ``decode``. Without ``deferred``, ``e`` and ``s`` are
    updated to the new errors; with it, see ``Deferred``. Collective over ``comm``.
    ``size_tag`` and ``agree``: see ``_phase1`` (used by ``hierarchical``).
    """
    pend = _Pending()
    try:
        return _allreduce(comm, fam, lay, g, out, e, s, ws, deferred, pend, size_tag, agree)
    finally:
        pend.wait()  # an error on the way leaves no request behind


def _allreduce(comm, fam, lay, g, out, e, s, ws, deferred, pend, size_tag=None, agree=None):
    p, chunk, m = lay.world_size, lay.chunk, lay.numel
    pieces = lay.pieces()
    wscales, scale = _phase1(comm, fam, lay, g, e, ws, deferred, pend, size_tag, agree)

    coef = (wscales.astype(np.float64) / p).astype(np.float32)
    recv, gsend = fam.view(ws.recv), fam.view(ws.gsend)
    spend = 0.0 if deferred is None else deferred.server_pending
    share = -(-lay.padded // (8 * len(pieces))) * 8  # worker error update per piece
    sss = 0.0
    for k, (lo, hi) in enumerate(pieces):
        last = k == len(pieces) - 1
        trailer = P2_TRAILER if last else 0
        block = _block(recv, p, lo, hi, P1_TRAILER if last else 0)
        for sl, sh in _steps(lo, hi):
            sss += fam.server_accumulate(block[:, sl - lo:sh - lo], coef, s[8 * sl:8 * sh],
                                         gsend[sl:sh], spend)
            pend.progress()
        if last:
            sscale = np.float32(math.sqrt(sss / chunk))
            ws.gsend[hi:].copy_(_trailer(np.array([sscale], np.float32)).to(ws.gsend.device))
        pend.post(comm.all_gather_into_tensor, _block(ws.grecv, p, lo, hi, trailer),
                  ws.gsend[lo:hi + trailer], len(pieces) == 1)
        if deferred is None:  # the worker error update overlaps the transfers
            for a in range(k * share, min((k + 1) * share, lay.padded), 8 * STEP_BYTES):
                b = min(a + 8 * STEP_BYTES, (k + 1) * share, lay.padded)
                fam.worker_residual(g[min(a, m):min(b, m)], e[a:b], float(scale))
                pend.progress()
    if deferred is None:
        fam.server_residual(s, float(sscale))
    pend.wait()

    if out is not None:
        decode(fam, lay, ws.grecv, out)
    return float(scale), float(sscale)


def decode(fam, lay: Layout, grecv: torch.Tensor, out) -> None:
    """Decode a phase-2 result (``grecv``: the gathered uint8 messages of ``lay``, as
    ``Workspace.grecv`` holds them after ``allreduce``) into ``out``, cut at out's length
    (at most ``lay.padded`` elements; the rest is padding)."""
    p, chunk, m = lay.world_size, lay.chunk, out.shape[0]
    pieces = lay.pieces()
    rec = fam.view(grecv)
    lo, hi = pieces[-1]
    sscales = _block(grecv, p, lo, hi, P2_TRAILER)[:, hi - lo:].cpu().contiguous().numpy()
    sscales = sscales.copy().view(np.float32).reshape(p)
    for lo, hi in pieces:
        rows = _block(rec, p, lo, hi, P2_TRAILER if hi == pieces[-1][1] else 0)
        for r in range(p):
            a, b = r * chunk + 8 * lo, min(r * chunk + 8 * hi, m)
            if a < b:
                fam.decode(rows[r:r + 1, :hi - lo], sscales[r:r + 1], out[a:b])


def reduce_scatter(comm, fam, lay: Layout, g, out, e, ws: Workspace) -> float:
    """Phase 1 alone: ``out`` (chunk elements) = this rank's chunk of the mean over ranks of
    scale_i * sign(x_i); ``e`` is updated to x - scale * sign(x). Returns this rank's scale."""
    return reduce_scatter_start(comm, fam, lay, g, out, e, ws, False)()


def reduce_scatter_start(comm, fam, lay: Layout, g, out, e, ws: Workspace,
                         async_op: bool = True) -> Callable[[], float]:
    """``reduce_scatter`` in two halves: pack and post now (async with ``async_op``), and
    return ``finish()``, which waits, checks, writes ``out`` and ``e`` and returns the scale.
    ``g`` must stay unchanged and ``ws`` unused until ``finish`` has run."""
    if not async_op and isinstance(g, np.ndarray) and len(lay.pieces()) == 1:
        return _reduce_scatter_one_piece(comm, fam, lay, g, out, e, ws)
    pend = _Pending()
    try:
        scale = _phase1_send(comm, fam, lay, g, e, ws, None, pend, None, async_op)
    except BaseException:
        pend.wait()  # an error on the way leaves no request behind
        raise

    def finish() -> float:
        pend.wait()
        wscales = _phase1_check(lay, ws, None)
        p, m = lay.world_size, lay.numel
        coef = (wscales.astype(np.float64) / p).astype(np.float32)
        recv, gsend = fam.view(ws.recv), fam.view(ws.gsend)
        pieces = lay.pieces()
        out[:] = 0
        for lo, hi in pieces:
            rows = _block(recv, p, lo, hi, P1_TRAILER if hi == pieces[-1][1] else 0)[:, :hi - lo]
            fam.server_accumulate(rows, coef, out[8 * lo:8 * hi], gsend[lo:hi])
        fam.worker_residual(g[:m], e, scale)
        return scale
    return finish


def _one_piece_views(fam, lay: Layout, ws: Workspace) -> tuple:
    """Host views of a one-piece phase 1's messages, made once per workspace: each row's sign
    bytes and the (p, 2) uint32 trailers (scale, size) of the send and receive buffers."""
    views = ws.scratch.get("one_piece")
    if views is None:
        p = lay.world_size
        (lo, hi), = lay.pieces()
        smsg, rmsg = _block(ws.send, p, lo, hi, P1_TRAILER), _block(ws.recv, p, lo, hi, P1_TRAILER)
        srows, rrows = fam.view(smsg), fam.view(rmsg)
        views = ws.scratch["one_piece"] = (
            smsg, rmsg, [srows[j:j + 1, :hi - lo] for j in range(p)], srows[:, hi - lo:].view(np.uint32),
            rrows[:, :hi - lo], rrows[:, hi - lo:].view(np.uint32), fam.view(ws.gsend)[lo:hi])
    return views


def _reduce_scatter_one_piece(comm, fam, lay: Layout, g, out, e, ws: Workspace) -> Callable[[], float]:
    """``reduce_scatter_start`` blocking, for host arrays and a chunk sent as one piece: the
    same passes and messages without the per-piece bookkeeping (the views are kept)."""
    p, chunk, m = lay.world_size, lay.chunk, lay.numel
    smsg, rmsg, sign_rows, stail, rsigns, rtail, gsend = _one_piece_views(fam, lay, ws)
    span = 8 * gsend.shape[0]
    ssq = 0.0
    for j in range(p):
        a = j * chunk
        ssq += fam.encode(g[min(a, m):min(a + span, m)], e[a:a + span], sign_rows[j])
    scale = np.float32(math.sqrt(ssq / lay.padded))
    stail[:, 0] = scale.view(np.uint32)
    stail[:, 1] = m % (1 << 32)
    comm.all_to_all_single(rmsg, smsg)
    wscales = _tails_check(lay, rtail[:, 1], rtail[:, 0].view(np.float32), None)
    coef = (wscales.astype(np.float64) / p).astype(np.float32)
    out[:] = 0
    fam.server_accumulate(rsigns, coef, out[:span], gsend)
    fam.worker_residual(g[:m], e, scale)
    return lambda: float(scale)
