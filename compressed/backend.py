"""MpiBackend: DeepSpeed-compatible 1-bit compressed allreduce over an mpicomm Communicator.

One call runs two phases on small byte messages (see ``layout.Layout``):

1. every rank packs the signs of x = input + worker_error and sends chunk j to rank j
   (all-to-all), and its float32 worker scale to all (a 4-byte allgather);
2. every rank combines its chunk from all ranks with its server error, packs the signs and
   all-gathers them headed by its server scale; all ranks decode the same mean estimate.

Host path (CPU buffers): phase 1 is pipelined. The chunks for the other ranks are packed first
and sent with a non-blocking all-to-all; the rank's own chunk is packed while they travel, in
pieces with MPI progress calls between them; the scale (which needs the whole sum of squares)
follows, and the worker error update overlaps the rest of the transfer. The math is DeepSpeed's.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from . import kernels as K
from . import torch_kernels as TK
from .errors import NonFiniteError
from .layout import HEADER_BYTES as H
from .layout import Layout

__all__ = ["MpiBackend"]

_MAX_WORKSPACES = 4
_PIECE = 1 << 20  # elements per piece of work between two MPI progress calls (multiple of 8)


def as_communicator(comm: Any):
    """An mpicomm Communicator from None (the world), an mpicomm Communicator or an mpi4py Comm."""
    import mpicomm

    if comm is None:
        return mpicomm.init()
    if isinstance(comm, mpicomm.Communicator):
        return comm
    if isinstance(comm, MPI.Comm):
        return mpicomm.Communicator(comm)
    raise TypeError(f"comm: expected None, an mpicomm.Communicator or an mpi4py Comm, "
                    f"got {type(comm).__name__}")


def _is_cupy(x: Any) -> bool:
    return hasattr(x, "__cuda_array_interface__") and type(x).__module__.startswith("cupy")


def _numel(x: Any) -> int:
    return int(x.numel()) if isinstance(x, torch.Tensor) else int(x.size)


def _host_view(x: Any) -> np.ndarray:
    """numpy array of a CPU tensor or numpy array (a view sharing memory, except for bfloat16)."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.device.type != "cpu":
            raise TypeError(f"compressed_allreduce: host kernels need CPU buffers, got {_describe(x)}")
        if t.dtype == torch.bfloat16:
            return t.float().numpy()
        return t.numpy()
    return x


def _host_f32(x: Any) -> np.ndarray | None:
    """Flat float32 numpy view sharing ``x``'s memory, or None if ``x`` is not contiguous float32."""
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.float32 or not x.is_contiguous() or x.device.type != "cpu":
            return None
        return x.detach().reshape(-1).numpy()
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        return None
    return x.reshape(-1)


def _describe(x: Any) -> str:
    kind = "numpy.ndarray" if isinstance(x, np.ndarray) else type(x).__name__
    dev = f" on {x.device}" if isinstance(x, torch.Tensor) else ""
    return f"{kind} {tuple(x.shape)} {x.dtype}{dev}"


class MpiBackend:
    """1-bit compressed allreduce with worker and server error feedback (DeepSpeed's MpiBackend).

    ``comm`` is an mpicomm Communicator, an mpi4py communicator, or None for the world.
    With ``cuda_aware=True`` device buffers go to mpicomm as they are (which passes them to a
    CUDA-aware MPI, or stages them); with False this class stages its small messages through
    host memory itself. ``kernels`` may force "host" (numpy/numba) or "torch" kernels; by default
    host for CPU buffers and torch for device buffers.

    ``wire_bytes`` counts the bytes this rank sent, ``calls`` the calls made.
    """

    def __init__(self, cuda_aware: bool = False, comm: Any = None, *, kernels: str | None = None) -> None:
        if kernels not in (None, "host", "torch"):
            raise ValueError(f"kernels: expected None, 'host' or 'torch', got {kernels!r}")
        self.comm = as_communicator(comm)
        self.cuda_aware = bool(cuda_aware)
        self.rank = self.comm.rank
        self.size = self.comm.size
        self.kernels = kernels
        self.calls = 0
        self.wire_bytes = 0
        self._workspaces: OrderedDict[tuple, dict] = OrderedDict()

    # ------------------------------------------------------------------------------------------
    def compressed_allreduce(self, buffer_m, worker_error, server_error, local_rank: int = 0):
        """Overwrite ``buffer_m`` with the compressed mean of every rank's ``buffer_m``; return it.

        - ``buffer_m``: torch tensor (CPU or device), numpy or cupy array, any shape, a float dtype;
          computed in float32. On success it is overwritten, whole, with the mean estimate (same
          shape and dtype) and returned (the same object).
        - ``worker_error``: contiguous float32, ``padded_size(buffer_m.numel(), world_size)``
          elements; updated in place to x - scale * sign(x), x = padded input + old error.
        - ``server_error``: contiguous float32, that size / world_size elements; updated in place.
        - ``local_rank`` is accepted for DeepSpeed compatibility and unused.

        If any rank's input is not finite, every rank raises ``NonFiniteError`` after the first
        exchange and no buffer is modified on any rank. Every rank must call with the same size.
        """
        if _is_cupy(buffer_m):  # zero-copy torch views; results land in the cupy arrays
            buf, we, se = (torch.from_dlpack(x) if _is_cupy(x) else x
                           for x in (buffer_m, worker_error, server_error))
            self.allreduce_into(buf, buf, we, se)
            return buffer_m
        self.allreduce_into(buffer_m, buffer_m, worker_error, server_error)
        return buffer_m

    def allreduce_into(self, inp, out, worker_error, server_error) -> None:
        """Write the compressed mean of every rank's ``inp`` into ``out``; ``inp`` is only read.

        ``out`` has ``inp``'s number of elements, any float dtype, and may be ``inp`` itself
        (that is ``compressed_allreduce``). Errors and failure behave as there.
        """
        p = self.size
        n = _numel(inp)
        lay = Layout(n, p)
        self._check_buffers(inp, worker_error, server_error, lay)
        if _numel(out) != n or isinstance(out, torch.Tensor) != isinstance(inp, torch.Tensor):
            raise ValueError(f"compressed_allreduce: out must be the same kind of buffer with "
                             f"{n} elements, got {_describe(out)}")
        if n == 0:
            return
        if not self.host_kernels_for(inp):
            self._torch_allreduce(inp, out, worker_error, server_error, lay)
        else:
            self._host_allreduce(inp, out, worker_error, server_error, lay)
        self.calls += 1
        self.wire_bytes += lay.wire_bytes()

    def host_kernels_for(self, inp) -> bool:
        """Whether a call on ``inp`` runs the host (numpy/numba) kernels, not the torch ones."""
        return not (self.kernels == "torch" or (
            self.kernels is None and isinstance(inp, torch.Tensor) and inp.device.type != "cpu"))

    def allreduce_deferred(self, inp, out, worker_x, server_s, x_out, worker_pending: float,
                           server_pending: float) -> tuple[float, float]:
        """Host-kernel allreduce with deferred error updates (used by ``OnebitAllreduce``).

        ``worker_x`` and ``server_s`` hold the previous call's x and s; their error updates
        (x - pending * sign(x)) are still to be applied. This call's x goes to ``x_out`` (a
        buffer like ``worker_x``; ``worker_x`` is only read) and ``server_s`` is corrected and
        overwritten by this call's s. Returns the (worker, server) scales, the new pending
        scales of ``x_out`` and ``server_s``. On ``NonFiniteError`` nothing but ``x_out`` was
        written. The math is that of ``allreduce_into`` (DeepSpeed's), reordered only.
        """
        n = _numel(inp)
        lay = Layout(n, self.size)
        self._check_buffers(inp, worker_x, server_s, lay)
        self._check_buffers(inp, x_out, server_s, lay)
        if n == 0 or not self.host_kernels_for(inp):
            raise ValueError("allreduce_deferred: needs a non-empty buffer for the host kernels")
        scales = self._host_allreduce(inp, out, worker_x, server_s, lay,
                                      deferred=(x_out, float(worker_pending), float(server_pending)))
        self.calls += 1
        self.wire_bytes += lay.wire_bytes()
        return scales

    # ------------------------------------------------------------------------------------------
    def _check_buffers(self, buf, we, se, lay: Layout) -> None:
        call = "compressed_allreduce"
        for name, x in (("buffer_m", buf), ("worker_error", we), ("server_error", se)):
            if not isinstance(x, (torch.Tensor, np.ndarray)):
                raise TypeError(f"{call}: {name} must be a torch.Tensor or numpy.ndarray, "
                                f"got {type(x).__name__}")
        if isinstance(buf, np.ndarray) and buf.dtype.kind != "f":
            raise TypeError(f"{call}: buffer_m must have a floating dtype, got {_describe(buf)}")
        if isinstance(buf, torch.Tensor) and not buf.dtype.is_floating_point:
            raise TypeError(f"{call}: buffer_m must have a floating dtype, got {_describe(buf)}")
        for name, x, want, what in (
                ("worker_error", we, lay.padded, f"padded_size({lay.numel}, {lay.world_size})"),
                ("server_error", se, lay.chunk, f"padded_size({lay.numel}, {lay.world_size}) // "
                                                f"{lay.world_size}")):
            numel = _numel(x)
            if numel != want:
                raise ValueError(f"{call}: {name} must have {what} = {want} elements, "
                                 f"got {_describe(x)}")
            contiguous = x.is_contiguous() if isinstance(x, torch.Tensor) else x.flags.c_contiguous
            if str(x.dtype) not in ("float32", "torch.float32") or not contiguous:
                raise TypeError(f"{call}: {name} must be a contiguous float32 buffer, got {_describe(x)}")
            if isinstance(x, torch.Tensor) != isinstance(buf, torch.Tensor) or (
                    isinstance(x, torch.Tensor) and x.device != buf.device):
                raise TypeError(f"{call}: {name} must be the same kind of buffer on the same device "
                                f"as buffer_m ({_describe(buf)}), got {_describe(x)}")

    def _workspace(self, lay: Layout, device: torch.device | None) -> dict:
        key = (lay.padded, lay.world_size, str(device))
        ws = self._workspaces.get(key)
        if ws is None:
            p, row = lay.world_size, lay.row_bytes
            if device is None:
                ws = {"send": np.empty((p, row), np.uint8), "recv": np.empty((p, row), np.uint8),
                      "gsend": np.empty(row, np.uint8), "grecv": np.empty((p, row), np.uint8)}
            else:
                ws = {k: torch.empty(s, dtype=torch.uint8, device=device)
                      for k, s in (("send", (p, row)), ("recv", (p, row)),
                                   ("gsend", (row,)), ("grecv", (p, row)))}
            self._workspaces[key] = ws
            while len(self._workspaces) > _MAX_WORKSPACES:
                self._workspaces.popitem(last=False)
        else:
            self._workspaces.move_to_end(key)
        return ws

    def _raise_if_not_finite(self, scales: np.ndarray) -> None:
        bad = [r for r in range(scales.shape[0]) if not math.isfinite(float(scales[r]))]
        if bad:
            raise NonFiniteError(
                f"compressed_allreduce: the input (plus worker error) is not finite (inf or NaN) on "
                f"rank(s) {bad} of {scales.shape[0]}; expected finite values everywhere. No buffer "
                f"was modified.")

    # ------------------------------------------------------------------------------------------
    def _host_allreduce(self, inp, out, we, se, lay: Layout, deferred=None):
        """The host path. With ``deferred`` = (x buffer, worker pending, server pending) the error
        updates are deferred (``OnebitAllreduce``): ``we`` and ``se`` hold x and s of the previous
        call, still to be corrected by their pending scales; this call's x is written into the x
        buffer (``we`` is only read, so a failed call changes nothing), ``se`` is corrected
        inside the server pass, and (worker scale, server scale) are returned: the new pending
        scales of the x buffer and ``se``, left uncorrected."""
        p = lay.world_size
        ws = self._workspace(lay, None)
        g = _host_f32(inp)
        if g is None:  # convert into a kept scratch buffer (fresh large arrays cost page faults)
            g = ws.setdefault("g32", np.empty(lay.numel, np.float32))
            g[...] = _host_view(inp).reshape(-1)
        dst = _host_f32(out)
        e = _host_view(we).reshape(-1)
        s = _host_view(se).reshape(-1)
        send, recv, gsend, grecv = ws["send"], ws["recv"], ws["gsend"], ws["grecv"]
        r, m, chunk, cb = self.rank, g.shape[0], lay.chunk, lay.chunk_bytes
        if deferred is not None:
            xbuf, wpend, spend = deferred
            xbuf = _host_view(xbuf).reshape(-1)

        def encode(lo: int, hi: int, rows: np.ndarray) -> float:  # elements [lo, hi) -> rows
            gp = g[min(lo, m):min(hi, m)]
            if deferred is None:
                return K.encode(gp, e[lo:hi], rows)
            return K.encode_into(gp, e[lo:hi], wpend, xbuf[lo:hi], rows)

        # Phase 1, pipelined: the chunks for the other ranks are packed and put on the wire
        # first; this rank's own chunk is packed (straight into its receive row) while they
        # travel, with MPI progress between pieces. The scales (which need the whole sum of
        # squares) follow in a small allgather, which also tells every rank about non-finite input.
        mpi = self.comm.mpi_comm
        if getattr(self.comm, "check", False):  # checking mode: sizes agree, or all ranks raise
            from mpicomm.checking import agree
            agree(mpi, "compressed_allreduce", f"numel={lay.numel}")
        ssq = 0.0
        for j in range(p):
            if j != r:
                ssq += encode(j * chunk, (j + 1) * chunk, send[j:j + 1, H:])
        counts = [0 if j == r else cb for j in range(p)]
        displs = [j * lay.row_bytes + H for j in range(p)]
        req = mpi.Ialltoallv([send, (counts, displs), MPI.BYTE], [recv, (counts, displs), MPI.BYTE])
        for lo in range(r * chunk, (r + 1) * chunk, _PIECE):
            hi = min(lo + _PIECE, (r + 1) * chunk)
            ssq += encode(lo, hi, recv[r:r + 1, H + (lo - r * chunk) // 8:H + (hi - r * chunk) // 8])
            req.Test()
        scale = np.float32(math.sqrt(ssq / lay.padded))
        wscales = np.empty(p, np.float32)
        mpi.Allgather(np.array([scale], np.float32), wscales)
        try:
            self._raise_if_not_finite(wscales)
        except NonFiniteError:
            req.Wait()
            raise
        if deferred is None:  # the worker error update overlaps the rest of the exchange
            for lo in range(0, lay.padded, _PIECE):
                hi = min(lo + _PIECE, lay.padded)
                K.worker_residual(g[min(lo, m):min(hi, m)], e[lo:hi], float(scale))
                req.Test()
        req.Wait()

        coef = (wscales.astype(np.float64) / p).astype(np.float32)
        sss = K.server_accumulate(recv[:, H:], coef, s, gsend[H:],
                                  0.0 if deferred is None else spend)
        sscale = np.float32(math.sqrt(sss / lay.chunk))
        gsend[:H] = np.frombuffer(sscale.tobytes(), np.uint8)
        work = self.comm.all_gather_into_tensor(grecv, gsend, async_op=True)
        if deferred is None:  # overlaps the second exchange
            K.server_residual(s, float(sscale))
        work.wait()
        sscales = grecv[:, :H].copy().view(np.float32).reshape(p)

        if dst is not None:
            K.decode(grecv[:, H:], sscales, dst)
        else:
            res = ws.setdefault("out32", np.empty(lay.numel, np.float32))
            K.decode(grecv[:, H:], sscales, res)
            if isinstance(out, torch.Tensor):
                out.detach().copy_(torch.from_numpy(res).view(out.shape))
            else:
                out[...] = res.reshape(out.shape)
        return float(scale), float(sscale)

    # ------------------------------------------------------------------------------------------
    def _torch_allreduce(self, inp, out, we, se, lay: Layout) -> None:
        p = lay.world_size
        if isinstance(inp, np.ndarray):
            raise TypeError("compressed_allreduce: torch kernels need torch tensors, got a numpy array")
        dev = inp.device
        g = inp.detach().reshape(-1).to(torch.float32)
        e = we.detach().view(-1)
        s = se.detach().view(-1)
        ws = self._workspace(lay, dev)
        send, recv, gsend, grecv = ws["send"], ws["recv"], ws["gsend"], ws["grecv"]

        x = TK.padded_sum(g, e)
        scale = TK.sumsq(x).div_(lay.padded).sqrt_().to(torch.float32).reshape(1)
        send[:, H:] = TK.pack(x).view(p, lay.chunk_bytes)
        send[:, :H] = scale.view(torch.uint8)
        recv_host = self._exchange(self.comm.all_to_all_single, recv, send)
        wscales_host = recv_host[:, :H].reshape(-1).view(torch.float32)
        self._raise_if_not_finite(wscales_host.cpu().numpy())

        TK.residual_(x, scale, e)
        del x
        rows = recv_host[:, H:].to(dev, non_blocking=True)
        coef = wscales_host.to(dev, torch.float64).div_(p).to(torch.float32)
        TK.server_accumulate(rows, coef, s)
        sscale = TK.sumsq(s).div_(lay.chunk).sqrt_().to(torch.float32).reshape(1)
        gsend[H:] = TK.pack(s)
        gsend[:H] = sscale.view(torch.uint8)
        TK.residual_(s, sscale, s)
        grecv_any = self._exchange(self.comm.all_gather_into_tensor, grecv, gsend)
        grecv_dev = grecv_any.to(dev, non_blocking=True)
        sscales = grecv_dev[:, :H].reshape(-1).view(torch.float32)
        res = torch.empty(lay.numel, dtype=torch.float32, device=dev)
        TK.decode(grecv_dev[:, H:], sscales, res)
        out.detach().copy_(res.view(out.shape))

    def _exchange(self, collective, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """Run ``collective(out, inp)``; stage through host memory for device buffers unless
        cuda_aware. Returns the tensor holding the result (``out`` or its host copy)."""
        if out.device.type == "cpu" or self.cuda_aware:
            collective(out, inp)
            return out
        inp_h = inp.to("cpu")
        out_h = torch.empty(out.shape, dtype=out.dtype)
        collective(out_h, inp_h)
        return out_h
