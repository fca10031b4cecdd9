"""Horovod's PyTorch API on mpicomm: a Horovod script changes ``import horovod.torch as hvd``
to ``import mpicomm.horovod as hvd`` and runs under ``mpirun`` on the cluster's MPI.

Modules: ``basics`` (init, ranks, what is built), ``engine`` (the rounds that match calls
across ranks), ``calls`` (each kind of call), ``ops`` (the async and in-place collectives,
join, barrier), ``autograd`` (the blocking, differentiable ones), ``handles`` (poll,
synchronize), ``process_sets``, ``functions`` (broadcast_parameters / optimizer_state /
object), ``compression``, ``optimizer`` (DistributedOptimizer), ``elastic`` (hvd.elastic, on
the ``elastic`` package, imported when used). See docs/horovod.md.
"""
from __future__ import annotations

from .autograd import (allgather, allreduce, alltoall, broadcast, grouped_allgather,
                       grouped_allreduce, grouped_reducescatter, reducescatter,
                       sparse_allreduce_async)
from .basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                     gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size,
                     mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built,
                     shutdown, size, start_timeline, stop_timeline)
from .calls import Adasum, Average, Max, Min, Product, Sum
from .compression import Compression
from .errors import HorovodInternalError
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .handles import poll, synchronize
from .ops import (allgather_async, allreduce_, allreduce_async, allreduce_async_, alltoall_async,
                  barrier, broadcast_, broadcast_async, broadcast_async_, grouped_allgather_async,
                  grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                  grouped_reducescatter_async, join, reducescatter_async)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set


def __getattr__(name: str):
    if name == "elastic":  # above mpicomm: imported when used
        import importlib
        return importlib.import_module(".elastic", __name__)
    if name == "HostsUpdatedInterrupt":
        from .errors import hosts_updated_interrupt
        return hosts_updated_interrupt()
    raise AttributeError(f"module 'mpicomm.horovod' has no attribute {name!r}")


__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "synchronize", "poll", "join",
    "barrier", "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
    "allgather_object", "DistributedOptimizer", "Compression", "ProcessSet",
    "add_process_set", "remove_process_set", "global_process_set", "HorovodInternalError",
]
