"""Transport for the 1-bit engine: an mpicomm Communicator, or any torch.distributed process group.

The engine (``compressed.engine``) and the classes above it call a handful of communicator
methods: ``rank``, ``size``, ``local_size``, async ``all_to_all_single`` and
``all_gather_into_tensor`` (handles with ``wait()`` and ``is_completed()``), and
``all_reduce(t, op="avg")``. ``GroupTransport`` gives a process group (mpicomm's, gloo, NCCL
on GPUs, ...) that same interface through ``torch.distributed``'s functions, so one engine and
one wire format serve both; ``as_comm`` picks the transport for a ``comm=`` argument.
"""
from __future__ import annotations

from typing import Any

import torch

import mpicomm

__all__ = ["GroupTransport", "as_comm", "is_process_group"]


def is_process_group(obj: Any) -> bool:
    """Whether ``obj`` is a torch.distributed ProcessGroup."""
    if obj is None:
        return False
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return dist.is_available() and isinstance(obj, dist.ProcessGroup)


def as_comm(comm: Any) -> Any:
    """The transport for ``comm``: a process group becomes a ``GroupTransport``; anything else
    goes through ``mpicomm.as_communicator`` (a Communicator, an MPI communicator, None = world)."""
    if isinstance(comm, GroupTransport):
        return comm
    if is_process_group(comm):
        return GroupTransport(comm)
    return mpicomm.as_communicator(comm)


_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN", "prod": "PRODUCT"}


class GroupTransport:
    """A torch.distributed process group seen through the Communicator methods the 1-bit engine
    uses. ``group=None`` is the default (world) group; torch.distributed must be initialised.

    All ranks are taken to share one node (``local_size == size``): the phases go in one piece,
    which is right on one node and costs only overlap across nodes.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("compressed: a process group transport needs torch.distributed "
                               "initialised (dist.init_process_group(...)) first")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.local_size = self.size
        self.backend = str(dist.get_backend(group))

    # the engine's (ranks, bytes) message views go flat: gloo matches shapes chunk by chunk
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        return self._dist.all_to_all_single(output.view(-1), input.view(-1), group=self.group,
                                            async_op=async_op)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        gather = getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor
        return gather(output.view(-1), input.view(-1), group=self.group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum", async_op: bool = False):
        """In place; ``op`` as mpicomm takes it ("sum", "avg", ... or a ReduceOp). AVG is a SUM
        then a division (gloo has no AVG)."""
        name = str(getattr(op, "name", op)).lower().replace("reduceop.", "")
        if name not in _OPS:
            raise ValueError(f"compressed: all_reduce op must be one of {sorted(_OPS)}, got {op!r}")
        if async_op and name == "avg":
            raise ValueError("compressed: async all_reduce with op='avg' is not offered on a process group")
        work = self._dist.all_reduce(tensor, op=getattr(self._dist.ReduceOp, _OPS[name]),
                                     group=self.group, async_op=async_op)
        if name == "avg":
            tensor.div_(self.size)
        return work

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)

    def __repr__(self) -> str:
        return f"GroupTransport({self.backend}, rank {self.rank} of {self.size})"
