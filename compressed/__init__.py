"""1-bit compressed allreduce (sign + scale with error feedback), 1-bit Adam and a DDP comm hook.

Public API:

- ``MpiBackend(cuda_aware=False, comm=None).compressed_allreduce(buffer_m, worker_error,
  server_error, local_rank)``: DeepSpeed's signature and algorithm; overwrites ``buffer_m`` with
  the mean estimate and returns it; updates both error buffers; changes nothing on any rank when
  some rank's input is not finite (``NonFiniteError`` everywhere) or the sizes differ
  (``SizeMismatchError``). ``compressed_reduce_scatter`` is phase 1 alone.
- ``padded_size(n, world_size)``: the worker error's size (n rounded up to 8 * world_size);
  the server error holds that / world_size.
- ``OnebitAllreduce(comm, hierarchical=None)``: ``ar(tensor, key)`` returns the compressed mean
  as a new tensor, keeping error buffers per key; identity at world size 1. ``hierarchical``
  (also on ``MpiBackend`` and ``OnebitDDPState``): None = full precision inside each node and
  1-bit across nodes when there are several nodes with several ranks each; False = flat.
- ``OnebitAdam``: Adam, then frozen variance and compressed momentum after ``freeze_step``.
- ``ZeroOneAdam``: 0/1 Adam (variance at doubling intervals, compressed gradients, then local
  steps with a compressed sync of the accumulated update at doubling intervals).
- ``OnebitLamb``: LAMB, then frozen variance and trust ratio, compressed scaled momentum.
- ``CompressedBackend(group=None)``: ``MpiBackend`` on any torch.distributed process group.
- ``Compressor(comm=None, kernels=None, hierarchical=None)``: the core all of them run on:
  ``allreduce_into(inp, out, worker_error, server_error)`` (the compressed mean of ``inp``
  written into ``out``) and ``compressed_reduce_scatter``, over caller buffers.
- ``onebit_ddp_hook`` with ``OnebitDDPState``: DDP comm hook (warm-up and small buckets exact).
- ``fsdp``: int8 FSDP2 collectives (``QuantizedAllGather``, ``QuantizedReduceScatter``,
  ``quantize_comms``).

The optimizers and ``OnebitAllreduce`` take ``comm=`` as an mpicomm Communicator (or what
``mpicomm.as_communicator`` takes) or a torch.distributed process group (``transport``).

What lives where: ``wire_format`` (sizes and the wire format), ``engine`` (the algorithm, once, on
mpicomm's collectives), ``hierarchical`` (node structure and the hierarchical call),
``compressor`` (``Compressor``: buffers, workspaces, the hierarchy decision), ``families``
(kernel families behind one interface, and the choice among them), ``kernels`` with
``_numba_kernels``/``_numpy_kernels`` (host kernels), ``torch_kernels`` (device kernels),
``transport`` (a process group as the engine's communicator), ``adam_update`` (the 1-bit Adam
family's checks and update), ``onebit_optimizer`` (the 1-bit optimizers' step frame and
checkpointed counters), ``flat`` (means of many tensors in one call),
``deepspeed_backend`` (``MpiBackend``, ``CompressedBackend``: DeepSpeed's compression backends,
not torch.distributed backends)/``allreduce``/``adam``/``zoadam``/``lamb``/``ddp_hook`` (the
public classes), ``errors``.
"""
from __future__ import annotations

import importlib
from typing import Any

from .adam import OnebitAdam
from .allreduce import OnebitAllreduce
from .compressor import Compressor
from .ddp_hook import OnebitDDPState, onebit_ddp_hook
from .deepspeed_backend import CompressedBackend, MpiBackend
from .errors import NonFiniteError, SizeMismatchError
from .lamb import OnebitLamb
from .transport import GroupTransport
from .wire_format import padded_size
from .zoadam import ZeroOneAdam

__all__ = ["Compressor", "MpiBackend", "CompressedBackend", "GroupTransport", "OnebitAllreduce",
           "OnebitAdam", "ZeroOneAdam", "OnebitLamb", "OnebitDDPState", "onebit_ddp_hook",
           "NonFiniteError", "SizeMismatchError", "padded_size", "fsdp"]


def __getattr__(name: str) -> Any:
    """``compressed.fsdp`` on first use: it imports torch's FSDP2 (about 0.6 s), which a job
    without FSDP2 (and a replacement elastic spawns into one) need not wait for."""
    if name == "fsdp":
        return importlib.import_module(".fsdp", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
