"""Kernel families behind one interface: host (numba or numpy, on numpy arrays) and torch.

The algorithm in ``engine`` calls only these methods, on flat float32 arrays of the family's
kind (numpy for host, torch for torch) and uint8 message rows, so every family puts the same
bytes on the wire (``layout``). Scales and sums of squares come back as Python floats.

Why three families (``python -m bench compressed --sizes 16M --kernels K``, 2 ranks, one run
each on a loaded machine, ms): the 1-bit allreduce took 40 with numba, 119 with numpy and 477
with torch ops on CPU (compress 10 / 51 / 235, decompress 2.9 / 12.7 / 48.6; memcpy 4.2-5.0).
numba is the default; numpy is the fallback when numba is not installed; torch is the family
for device tensors (on CPU only when forced, e.g. to test that families interoperate).
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import torch

from . import kernels as K
from . import torch_kernels as TK


class NodeMean:
    """A part of a node's mean not yet written anywhere: (acc + last) / parts elementwise in
    float32, rounded as ``node_mean`` rounds it. Slicing slices both rows, so the engine's
    pieces and steps cut it as they cut an array; ``HostFamily.encode`` computes it as it packs
    (a hierarchical call's node mean then never goes through memory)."""

    __slots__ = ("acc", "last", "parts")

    def __init__(self, acc, last, parts: int) -> None:
        self.acc, self.last, self.parts = acc, last, int(parts)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.acc.shape

    def __getitem__(self, sl: slice) -> "NodeMean":
        return NodeMean(self.acc[sl], self.last[sl], self.parts)


class HostFamily:
    """numba- or numpy-fused CPU kernels (``compressed.kernels``) on numpy arrays; ``encode``
    and ``worker_residual`` also take g as bfloat16 bits (uint16), widened inside the pass."""

    device = torch.device("cpu")

    def __init__(self, name: str | None = None) -> None:
        self.mod: ModuleType = K.module(name)
        self.name = K.implementation_of(self.mod)

    def view(self, t: torch.Tensor) -> np.ndarray:
        """The family's array sharing ``t``'s memory (t is a CPU tensor)."""
        return t.numpy()

    #: ``lazy_node_mean`` exists: a hierarchical call may hand ``encode`` a ``NodeMean``.
    fuses_node_mean = True

    def encode(self, g, e, rows, x=None, pend: float = 0.0) -> float:
        if isinstance(g, NodeMean):
            if x is None:
                raise TypeError("HostFamily.encode: a NodeMean input needs x (the deferred form)")
            return float(self.mod.encode_mean_into(g.acc, g.last, g.parts, e, float(pend), x, rows))
        if g.dtype == np.uint16:    # bfloat16 bits (compressed.fsdp's blocking calls)
            if x is not None:
                raise TypeError("HostFamily.encode: bfloat16 input has no deferred form")
            return float(self.mod.encode_bf16(g, e, rows))
        if x is None:
            return float(self.mod.encode(g, e, rows))
        return float(self.mod.encode_into(g, e, float(pend), x, rows))

    def worker_residual(self, g, e, scale: float) -> None:
        if g.dtype == np.uint16:
            self.mod.worker_residual_bf16(g, e, float(scale))
        else:
            self.mod.worker_residual(g, e, float(scale))

    def server_accumulate(self, rows, coef: np.ndarray, se, out, pend: float = 0.0) -> float:
        return float(self.mod.server_accumulate(rows, coef, se, out, float(pend)))

    def server_residual(self, se, scale: float) -> None:
        self.mod.server_residual(se, float(scale))

    def decode(self, rows, scales: np.ndarray, out) -> None:
        self.mod.decode(rows, scales, out)

    def node_mean(self, src, recv, j: int, parts: int, out) -> None:
        """out = (row_0 + ... + row_{parts-1}) / parts, added in row order, where row r is
        ``src[r*k:(r+1)*k]`` for r == j and ``recv[r*k:(r+1)*k]`` otherwise (k = out.size).
        The last add and the divide run as one pass (``add_mean``)."""
        if parts == 1:
            out[:] = src[:out.shape[0]]
            return
        mean = self.lazy_node_mean(src, recv, j, parts, out)
        self.mod.add_mean(mean.acc, mean.last, parts, out)

    def lazy_node_mean(self, src, recv, j: int, parts: int, scratch) -> "NodeMean":
        """``node_mean`` (parts > 1) up to its last add and divide, which are left to the pass
        that reads it (``encode`` with a ``NodeMean``): rows 0 to parts - 2 are added in row
        order into ``scratch`` (k elements; untouched for parts == 2)."""
        k = scratch.shape[0]
        rows = [(src if r == j else recv)[r * k:(r + 1) * k] for r in range(parts)]
        acc = rows[0]
        for row in rows[1:-1]:
            np.add(acc, row, out=scratch)
            acc = scratch
        return NodeMean(acc, rows[-1], parts)


class TorchFamily:
    """torch ops (``compressed.torch_kernels``) on tensors of one device (CUDA, or CPU when forced)."""

    name = "torch"
    fuses_node_mean = False

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def view(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def _signed(self, x: torch.Tensor, pend: float) -> torch.Tensor:
        return torch.where(x >= 0, x - pend, x + pend) if pend else x

    def encode(self, g, e, rows, x=None, pend: float = 0.0) -> float:
        base = self._signed(e, float(pend))
        xs = base.clone() if base is e else base
        xs[: g.numel()].add_(g)
        if x is not None:
            x.copy_(xs)
        rows.view(-1).copy_(TK.pack(xs))
        return float(TK.sumsq(xs))

    def worker_residual(self, g, e, scale: float) -> None:
        e[: g.numel()].add_(g)
        TK.residual_(e, torch.tensor(scale, dtype=torch.float32, device=e.device), e)

    def server_accumulate(self, rows, coef: np.ndarray, se, out, pend: float = 0.0) -> float:
        if pend:
            se.copy_(self._signed(se, float(pend)))
        TK.server_accumulate(rows, torch.from_numpy(coef).to(se.device), se)
        out.view(-1).copy_(TK.pack(se))
        return float(TK.sumsq(se))

    def server_residual(self, se, scale: float) -> None:
        TK.residual_(se, torch.tensor(scale, dtype=torch.float32, device=se.device), se)

    def decode(self, rows, scales: np.ndarray, out) -> None:
        TK.decode(rows, torch.from_numpy(scales).to(out.device), out)

    def node_mean(self, src, recv, j: int, parts: int, out) -> None:
        k = out.shape[0]
        rows = [(src if r == j else recv)[r * k:(r + 1) * k] for r in range(parts)]
        out.copy_(rows[0])
        for row in rows[1:]:
            out.add_(row)
        out.div_(parts)


#: What a ``kernels=`` argument may say: None (host kernels on CPU, torch elsewhere), "host" (the
#: default host implementation), "numba" or "numpy" (that host implementation), "torch".
KERNELS = (None, "host", "numba", "numpy", "torch")


def check_kernels(kernels: str | None) -> None:
    """Raise ValueError unless ``kernels`` is one of ``KERNELS``."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels: expected one of {KERNELS}, got {kernels!r}")


def family_for(kernels: str | None, device: torch.device) -> Any:
    """The family for ``kernels`` (None: host kernels on CPU, torch elsewhere) on ``device``:
    the one place that chooses kernels (host ones through ``kernels.module``)."""
    check_kernels(kernels)
    if kernels == "torch" or (kernels is None and device.type != "cpu"):
        return TorchFamily(device)
    if device.type != "cpu":
        raise TypeError(f"compressed: kernels={kernels!r} runs on CPU buffers, got a buffer on {device}")
    return HostFamily(None if kernels in (None, "host") else kernels)
