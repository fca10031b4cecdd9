"""Compressor: the 1-bit compressed allreduce with error feedback over the caller's buffers.

The core every 1-bit API stands on (``MpiBackend``, ``CompressedBackend``, ``OnebitAllreduce``,
the ZeRO 1-bit stage): it checks the caller's buffers (torch CPU or device tensors, numpy arrays,
any float dtype) and adapts them to flat float32 arrays of the kernel family's kind, keeps the
message workspaces, decides once between the flat and the hierarchical algorithm, and runs
``engine`` (flat) or ``hierarchical`` on the communicator's collectives, which also decide how
device buffers reach MPI (directly when CUDA-aware, else staged).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import torch

import mpicomm

from . import engine
from .families import check_kernels, family_for
from .hierarchical import Hierarchy
from .transport import as_comm
from .wire_format import Layout

__all__ = ["Compressor", "PIECES_ENV"]

_MAX_WORKSPACES = 4


def _one_node(comm: mpicomm.Communicator) -> bool:
    """Whether all of ``comm``'s ranks share one node (then phases go in one piece)."""
    return comm.local_size == comm.size


#: Tuning knob (same value on every rank): most pieces per phase across nodes (default
#: ``wire_format.MAX_PIECES``); more pieces overlap packing with the transfer.
PIECES_ENV = "MPICOMM_ONEBIT_PIECES"


def _env_pieces() -> int | None:
    text = os.environ.get(PIECES_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{PIECES_ENV}: expected a positive number of pieces, got {text!r}")
    return int(text)


def _numel(x: Any) -> int:
    return int(x.numel()) if isinstance(x, torch.Tensor) else int(x.size)


def _describe(x: Any) -> str:
    kind = "numpy.ndarray" if isinstance(x, np.ndarray) else type(x).__name__
    dev = f" on {x.device}" if isinstance(x, torch.Tensor) else ""
    return f"{kind} {tuple(x.shape)} {x.dtype}{dev}"


def _device(x: Any) -> torch.device:
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")


def _f32_view(x: Any):
    """Flat float32 view sharing ``x``'s memory, or None if ``x`` is not contiguous float32
    (or a tensor with torch's negative bit, whose memory is not its values)."""
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.float32 or not x.is_contiguous() or x.is_neg():
            return None
        return x.detach().reshape(-1)
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        return None
    return x.reshape(-1)


def _flat(fam, x):
    """``x`` (float32, contiguous) as a flat array of ``fam``'s kind, sharing its memory."""
    return fam.view(x.detach().reshape(-1)) if isinstance(x, torch.Tensor) else x.reshape(-1)


class Compressor:
    """1-bit compressed allreduce with worker and server error feedback over caller buffers.

    ``comm`` is anything ``compressed.transport.as_comm`` takes (an mpicomm Communicator, what
    ``mpicomm.as_communicator`` takes, or a torch.distributed process group). ``kernels``
    forces a kernel family: "numba" or "numpy" (host, CPU buffers), "host" (the default host
    one), "torch"; by default host kernels for CPU buffers and torch for device buffers
    (``compressed.families``). Every family puts the same bytes on the wire
    (``compressed.wire_format``).

    ``hierarchical``: None (default) runs ``compressed.hierarchical`` (full precision inside each
    node, 1-bit across nodes) when the communicator spans several nodes with the same number
    (> 1) of ranks each, else the flat algorithm; True insists (``ValueError`` on every rank
    otherwise); False always runs flat. Deciding asks the communicator's ranks which node they
    are on, so the constructor is collective unless the ranks share one node or False is given.

    ``wire_bytes`` counts the bytes this rank sent (to any rank), ``calls`` the calls made.
    """

    def __init__(self, comm: Any = None, *, kernels: str | None = None,
                 hierarchical: bool | None = None) -> None:
        check_kernels(kernels)
        if hierarchical not in (None, True, False):
            raise TypeError(f"hierarchical: expected None, True or False, got {hierarchical!r}")
        self.comm = as_comm(comm)
        self.rank = self.comm.rank
        self.size = self.comm.size
        self.kernels = kernels
        self.calls = 0
        self.wire_bytes = 0
        self._workspaces: OrderedDict[tuple, engine.Workspace] = OrderedDict()
        self._layouts: dict[int, Layout] = {}
        self._families: dict[str, Any] = {}
        # one node: shared memory, nothing to overlap; pieces would only add synchronisation
        self._max_pieces = 1 if _one_node(self.comm) else _env_pieces()
        self.hierarchy = Hierarchy(self.comm, hierarchical, self._max_pieces)
        self.hierarchical = self.hierarchy.enabled

    def allreduce_into(self, inp, out, worker_error, server_error,
                       deferred: engine.Deferred | None = None) -> tuple[float, float]:
        """Write the compressed mean of every rank's ``inp`` into ``out``; ``inp`` is only read.

        - ``inp``: torch tensor (CPU or device) or numpy array, any shape, a float dtype;
          computed in float32. ``out`` has its number of elements, any float dtype, the same
          kind of buffer, and may be ``inp`` itself.
        - ``worker_error``: contiguous float32, ``padded_size(inp.numel(), world_size)``
          elements; updated in place to x - scale * sign(x), x = padded input + old error.
        - ``server_error``: contiguous float32, that size / world_size elements; updated in place.
        - ``deferred`` (``engine.Deferred``, used by ``OnebitAllreduce``) defers the error
          updates: x goes to ``deferred.xout`` and the pending scales are applied in this pass.

        Returns the (worker, server) scales of this rank; (0, 0) for an empty buffer. If any
        rank's input is not finite, every rank raises ``NonFiniteError`` after the first
        exchange and no buffer is modified on any rank; if the ranks pass different sizes, every
        rank raises ``SizeMismatchError`` (a ``mpicomm.CollectiveMismatchError``) the same way.
        """
        n = _numel(inp)
        lay = self.layout(n)
        self._check_buffers(inp, worker_error, server_error, lay)
        if deferred is not None:
            self._check_buffers(inp, deferred.xout, server_error, lay)
        if _numel(out) != n or isinstance(out, torch.Tensor) != isinstance(inp, torch.Tensor):
            raise ValueError(f"compressed_allreduce: out must be the same kind of buffer with "
                             f"{n} elements, got {_describe(out)}")
        if n == 0:
            return 0.0, 0.0
        hier = self.hierarchy
        fam, ws = self._setup(inp, hier.layout(n) if hier.enabled else lay)
        g, dst = self._input(fam, ws, inp, lay), self._output(fam, ws, out, lay)
        we, se = _flat(fam, worker_error), _flat(fam, server_error)
        if deferred is not None:
            deferred = engine.Deferred(_flat(fam, deferred.xout), deferred.worker_pending,
                                       deferred.server_pending)
        if hier.enabled:
            scales = hier.allreduce(fam, n, g, dst, we, se, ws,
                                    lambda name, k: self._scratch(fam, ws, name, k), deferred)
        else:
            scales = engine.allreduce(self.comm, fam, lay, g, dst, we, se, ws, deferred)
        self._write_back(dst, out)
        self.calls += 1
        self.wire_bytes += self.call_wire_bytes(n)
        return scales

    def compressed_reduce_scatter(self, inp, out, worker_error):
        """Phase 1 alone: write into ``out`` this rank's chunk of the compressed mean; return it.
        Always the flat algorithm, whatever ``hierarchical`` says.

        ``inp``: any float buffer of n elements (only read); ``worker_error``: contiguous float32,
        ``padded_size(n, world_size)`` elements, updated in place (error feedback); ``out``:
        contiguous float32, ``padded_size(n, world_size) // world_size`` elements: chunk ``rank``
        of the mean over ranks of scale_i * sign(x_i), x_i = padded input + worker error of rank
        i (elements past n belong to the padding). Failures behave as ``allreduce_into``.
        """
        self.compressed_reduce_scatter_start(inp, out, worker_error, async_op=False)()
        return out

    def compressed_reduce_scatter_start(self, inp, out, worker_error,
                                        async_op: bool = True) -> Callable[[], float]:
        """``compressed_reduce_scatter`` in two halves: pack and post the transfer now (async
        with ``async_op``) and return ``finish()``, which waits for it, writes ``out`` and
        ``worker_error`` and returns this rank's scale (errors are raised there). Until
        ``finish`` has run, ``inp`` must stay unchanged and no other call of this compressor
        on that size may start (they share the message workspace)."""
        n = _numel(inp)
        lay = self.layout(n)
        self._check_buffers(inp, worker_error, out, lay, names=("inp", "worker_error", "out"))
        if n == 0:
            return lambda: 0.0
        fam, ws = self._setup(inp, lay)
        g = self._input(fam, ws, inp, lay)
        finish = engine.reduce_scatter_start(self.comm, fam, lay, g, _flat(fam, out),
                                             _flat(fam, worker_error), ws, async_op)
        self.count_reduce_scatter(lay)
        return finish

    def count_reduce_scatter(self, lay: Layout) -> None:
        """Count one reduce-scatter of ``lay`` (phase 1 alone) in ``calls`` and ``wire_bytes``."""
        self.calls += 1
        self.wire_bytes += lay.wire_bytes() - (self.size - 1) * (lay.chunk_bytes + 4)

    def host_plan(self, like, numel: int) -> tuple | None:
        """``(family, layout, workspace)`` of a call on ``numel`` elements of buffers like
        ``like`` when its kernels are host ones (numpy arrays), else None; for callers that run
        ``compressed.engine`` on buffers of their own, already checked."""
        fam = self.family(like)
        if fam.name == "torch":
            return None
        lay = self.layout(numel)
        return (fam, lay, self._setup(like, lay)[1])

    def call_wire_bytes(self, numel: int) -> int:
        """Bytes this rank sends (to any rank) in one ``allreduce_into`` of ``numel`` elements."""
        if self.hierarchy.enabled:
            return sum(self.hierarchy.wire_bytes(numel))
        return self.layout(numel).wire_bytes()

    def worker_used(self, numel: int) -> int:
        """Elements of the worker error a call on ``numel`` elements uses (the rest stays as is):
        all ``padded_size(numel, world_size)`` when flat, this rank's part when hierarchical."""
        if self.hierarchy.enabled:
            return self.hierarchy.layout(numel).numel
        return self.layout(numel).padded

    def layout(self, numel: int) -> Layout:
        """The wire layout of a call on ``numel`` elements (``compressed.wire_format``)."""
        lay = self._layouts.get(numel)
        if lay is None:
            if len(self._layouts) >= 64:  # sizes come and go: keep the recent ones
                self._layouts.clear()
            lay = self._layouts[numel] = Layout(numel, self.size, self._max_pieces)
        return lay

    def family(self, buf) -> Any:
        """The kernel family (``compressed.families``) a call on ``buf`` runs; ``.name`` is
        'numba', 'numpy' or 'torch'."""
        key = str(_device(buf))
        fam = self._families.get(key)
        if fam is None:
            fam = self._families[key] = family_for(self.kernels, _device(buf))
        return fam

    # ------------------------------------------------------------------------------------------
    def _setup(self, inp, lay: Layout):
        """Kernel family and message workspace (sized for ``lay``) for a call on ``inp``."""
        fam = self.family(inp)
        if isinstance(inp, np.ndarray) and fam.name == "torch":
            raise TypeError("compressed_allreduce: torch kernels need torch tensors, "
                            "got a numpy array")
        dev = _device(inp)
        key = (lay.padded, lay.world_size, str(dev))
        ws = self._workspaces.get(key)
        if ws is None:
            ws = self._workspaces[key] = engine.Workspace(lay, dev)
            while len(self._workspaces) > _MAX_WORKSPACES:
                self._workspaces.popitem(last=False)
        else:
            self._workspaces.move_to_end(key)
        return fam, ws

    def _scratch(self, fam, ws: engine.Workspace, name: str, n: int):
        """A float32 array of ``n`` elements kept with the workspace (fresh ones cost page
        faults)."""
        buf = ws.scratch.get(name)
        if buf is None or buf.shape[0] != n:
            fresh = torch.empty(n, dtype=torch.float32, device=fam.device)
            buf = ws.scratch[name] = fam.view(fresh)
        return buf

    def _input(self, fam, ws, inp, lay: Layout):
        g = _f32_view(inp)
        if g is not None:
            return fam.view(g) if isinstance(g, torch.Tensor) else g
        g = self._scratch(fam, ws, "g32", lay.numel)
        if isinstance(inp, torch.Tensor):
            src = inp.detach().reshape(-1)
            if isinstance(g, torch.Tensor):
                g.copy_(src)
            else:
                torch.from_numpy(g).copy_(src)
        else:
            g[...] = inp.reshape(-1)
        return g

    def _output(self, fam, ws, out, lay: Layout):
        dst = _f32_view(out)
        if dst is not None:
            return fam.view(dst) if isinstance(dst, torch.Tensor) else dst
        return self._scratch(fam, ws, "out32", lay.numel)

    @staticmethod
    def _write_back(dst, out) -> None:
        if _f32_view(out) is not None:
            return
        if isinstance(out, torch.Tensor):
            src = dst if isinstance(dst, torch.Tensor) else torch.from_numpy(dst)
            out.detach().copy_(src.view(out.shape))
        else:
            out[...] = np.asarray(dst).reshape(out.shape)

    def _check_buffers(self, buf, we, se, lay: Layout, names: tuple[str, str, str] = (
            "buffer_m", "worker_error", "server_error")) -> None:
        call = "compressed_allreduce"
        for name, x in zip(names, (buf, we, se)):
            if not isinstance(x, (torch.Tensor, np.ndarray)):
                raise TypeError(f"{call}: {name} must be a torch.Tensor or numpy.ndarray, "
                                f"got {type(x).__name__}")
        floating = (buf.dtype.kind == "f" if isinstance(buf, np.ndarray)
                    else buf.dtype.is_floating_point)
        if not floating:
            raise TypeError(f"{call}: {names[0]} must have a floating dtype, got {_describe(buf)}")
        for name, x, want, what in (
                (names[1], we, lay.padded, f"padded_size({lay.numel}, {lay.world_size})"),
                (names[2], se, lay.chunk, f"padded_size({lay.numel}, {lay.world_size}) // "
                                          f"{lay.world_size}")):
            if isinstance(x, torch.Tensor) and x.is_neg():
                raise ValueError(f"{call}: {name} must not be a tensor with torch's negative bit "
                                 f"set (is_neg()): pass {name}.resolve_neg()")
            numel = _numel(x)
            if numel != want:
                raise ValueError(f"{call}: {name} must have {what} = {want} elements, "
                                 f"got {_describe(x)}")
            contiguous = x.is_contiguous() if isinstance(x, torch.Tensor) else x.flags.c_contiguous
            if str(x.dtype) not in ("float32", "torch.float32") or not contiguous:
                raise TypeError(f"{call}: {name} must be a contiguous float32 buffer, "
                                f"got {_describe(x)}")
            if isinstance(x, torch.Tensor) != isinstance(buf, torch.Tensor) or (
                    isinstance(x, torch.Tensor) and x.device != buf.device):
                raise TypeError(f"{call}: {name} must be the same kind of buffer on the same "
                                f"device as {names[0]} ({_describe(buf)}), got {_describe(x)}")
