"""torch.distributed integration: the "mpicomm" process-group backend and a DDP comm hook.

``import mpicomm`` registers the backend. Under ``mpiexec``/``mpirun``/``srun``::

    dist.init_process_group("mpicomm")      # or mpicomm.distributed.init_process_group()

takes rank and world size from MPI and gives all ranks one TCPStore (hosted by rank 0). The
process group runs every call as a non-blocking MPI operation: ``async_op=True`` returns at
once and mpicomm's progress thread completes the work; every call fails past the group's
timeout. DDP, DeviceMesh, DTensor and FSDP2 run on it; :func:`allreduce_ddp_hook` routes only
DDP's gradient buckets through mpicomm when DDP runs on another process group.

Modules: ``_rendezvous`` (ranks and store from MPI), ``_registration`` (the torch.distributed backend's
registration and constructor),
``_pg`` (the process group), ``_work`` (work handles, timeouts), ``_deadlines`` (the one
thread that keeps every call's deadline), ``_ops`` (ReduceOp mapping), ``_monitored``
(``monitored_barrier``),
``_ddp_hook`` (the DDP comm hook), ``_reinit`` (``reinit_process_group``: the default group
again on the survivors of a rank failure).
"""
from __future__ import annotations

from ._ddp_hook import allreduce_ddp_hook
from ._monitored import monitored_barrier
from ._registration import init_process_group, register
from ._pg import BACKEND_NAME, MpicommProcessGroup
from ._reinit import reinit_process_group
from ._work import MpicommWork, ProcessGroupTimeoutError

__all__ = ["BACKEND_NAME", "MpicommProcessGroup", "MpicommWork", "ProcessGroupTimeoutError",
           "allreduce_ddp_hook", "init_process_group", "monitored_barrier", "register",
           "reinit_process_group"]

register()
