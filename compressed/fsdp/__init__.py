"""Compressed FSDP2 collectives: int8 weight all-gather and int8 gradient reduce-scatter.

Public API:

- ``QuantizedAllGather(bits=8, block=512)``: for ``FSDPModule.set_custom_all_gather``; each
  rank's shard travels as symmetric int8 per block (one fp32 scale per block); a rank's own
  slice stays exact; the sharded parameters (FSDP2's masters) are never touched.
- ``QuantizedReduceScatter(bits=8, block=512)``: for ``set_custom_reduce_scatter``; int8
  chunks through an all-to-all, summed in fp32 in rank order (SUM, AVG, PREMUL_SUM);
  ``bits=1``: signs and one scale per rank with error feedback (the 1-bit engine's phase 1).
- ``quantize_comms(module, weight_bits=8, grad_bits=8, warmup_steps=None)``: both on every
  FSDPModule under ``module`` (blocks never span two parameters); ``None`` leaves that side
  as FSDP2's own; ``grad_bits=1`` the 1-bit reduce-scatter, one error state per FSDPModule, after
  ``warmup_steps`` (default 20) full-precision steps.
- ``GradientErrors(model)``: those error states as one ckpt per-rank state item (resharded
  N -> M at load).

What lives where: ``quantize`` (the pure int8 math and wire format, the error bound),
``wires`` (reused host buffers), ``collectives`` (the two collectives on a process group),
``onebit`` (the 1-bit reduce-scatter's state), ``error_state`` (``GradientErrors``),
``install`` (``quantize_comms``).
"""
from __future__ import annotations

from .collectives import DEFAULT_BLOCK, QuantizedAllGather, QuantizedReduceScatter
from .error_state import GradientErrors
from .install import quantize_comms

__all__ = ["QuantizedAllGather", "QuantizedReduceScatter", "quantize_comms", "GradientErrors",
           "DEFAULT_BLOCK"]
