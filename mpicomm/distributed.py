"""torch.distributed integration: a process-group backend named "mpicomm" and a DDP comm hook.

``import mpicomm`` registers the backend. Then::

    mpicomm.distributed.init_process_group()      # or dist.init_process_group("mpicomm", ...)
    dist.all_reduce(t); dist.all_gather_into_tensor(out, t); ...

serves ``all_reduce``, ``all_gather_into_tensor``, ``all_gather``, ``reduce_scatter_tensor``,
``broadcast``, ``all_to_all_single``, ``reduce``, ``gather``, ``scatter``, ``send``/``recv`` and
``barrier`` through mpicomm.

DDP: torch's DistributedDataParallel cannot be built on a process group written in Python (its
constructor needs a C++ backend). Build DDP on any process group (gloo is enough: it is used
only to broadcast the initial parameters) and register :func:`allreduce_hook`, which averages
every gradient bucket through mpicomm::

    model = DDP(model, process_group=gloo_group)
    model.register_comm_hook(mpicomm.init(), mpicomm.distributed.allreduce_hook)
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from mpi4py import MPI

from .communicator import Communicator, init
from .ops import ReduceOp

BACKEND_NAME = "mpicomm"

_c10d = torch._C._distributed_c10d


_OPS = ((dist.ReduceOp.SUM, ReduceOp.SUM), (dist.ReduceOp.AVG, ReduceOp.AVG),
        (dist.ReduceOp.MAX, ReduceOp.MAX), (dist.ReduceOp.MIN, ReduceOp.MIN),
        (dist.ReduceOp.PRODUCT, ReduceOp.PROD))


def _op(red_op) -> ReduceOp:
    for theirs, ours in _OPS:
        if red_op == theirs:
            return ours
    raise ValueError(f"mpicomm process group: unsupported reduce op {red_op} "
                     "(expected SUM, AVG, MAX, MIN or PRODUCT)")


def _done(result) -> "dist.Work":
    fut = torch.futures.Future()
    fut.set_result(result)
    return _c10d._create_work_from_future(fut)


class MpicommProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run through an mpicomm Communicator.

    Calls are blocking: the returned work is already complete (``async_op=True`` is accepted).
    """

    def __init__(self, comm: Communicator) -> None:
        super().__init__(comm.rank, comm.size)
        self.comm = comm

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def allreduce(self, tensors, opts=None):
        op = _op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        for t in tensors:
            self.comm.all_reduce(t, op=op)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        for t in tensors:
            self.comm.broadcast(t, src=opts.rootRank)
        return _done(tensors)

    def reduce(self, tensors, opts):
        for t in tensors:
            self.comm.reduce(t, dst=opts.rootRank, op=_op(opts.reduceOp))
        return _done(tensors)

    def all_gather_single(self, output, input, opts=None):
        self.comm.all_gather_into_tensor(output, input)
        return _done([output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            self.comm.all_gather_into_tensor(o, i)
        return _done(outputs)

    def allgather(self, output_lists, inputs, opts=None):
        for outs, t in zip(output_lists, inputs):
            self.comm.all_gather(outs, t)
        return _done(output_lists)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def alltoall(self, outputs, inputs, opts=None):
        out_flat = torch.cat([o.reshape(-1) for o in outputs])
        self.comm.all_to_all_single(out_flat, torch.cat([i.reshape(-1) for i in inputs]),
                                    [o.numel() for o in outputs], [i.numel() for i in inputs])
        for o, piece in zip(outputs, out_flat.split([o.numel() for o in outputs])):
            o.copy_(piece.view(o.shape))
        return _done(outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        op = _op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        self.comm.reduce_scatter_tensor(output, input, op=op)
        return _done([output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = _op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        for o, i in zip(outputs, inputs):
            self.comm.reduce_scatter_tensor(o, i, op=op)
        return _done(outputs)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op = _op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        for out, chunks in zip(outputs, input_lists):
            self.comm.reduce_scatter_tensor(out, torch.cat([c.reshape(-1) for c in chunks]), op=op)
        return _done(outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        self.comm.all_to_all_single(output, input, output_split_sizes or None,
                                    input_split_sizes or None)
        return _done([output])

    def gather(self, output_lists, inputs, opts):
        gl = output_lists[0] if self.comm.rank == opts.rootRank else None
        self.comm.gather(inputs[0], gl, dst=opts.rootRank)
        return _done(output_lists)

    def scatter(self, outputs, input_lists, opts):
        sl = input_lists[0] if self.comm.rank == opts.rootRank else None
        self.comm.scatter(outputs[0], sl, src=opts.rootRank)
        return _done(outputs)

    def send(self, tensors, dst, tag):
        for t in tensors:
            self.comm.send(t, dst, tag)
        return _done(tensors)

    def recv(self, tensors, src, tag):
        for t in tensors:
            self.comm.recv(t, src, tag)
        return _done(tensors)

    def recv_anysource(self, tensors, tag):
        for t in tensors:
            self.comm.recv(t, None, tag)
        return _done(tensors)

    def barrier(self, opts=None):
        self.comm.barrier()
        return _done([])


def _create(backend_opts, pg_options=None) -> MpicommProcessGroup:
    """torch.distributed backend constructor (extended API): the MPI ranks of the new group."""
    world = MPI.COMM_WORLD
    ranks = list(backend_opts.global_ranks_in_group) or list(range(world.Get_size()))
    if dist.is_initialized() is False and len(ranks) == world.Get_size():
        me = backend_opts.group_rank
        if me != world.Get_rank() or backend_opts.group_size != world.Get_size():
            raise RuntimeError(
                f"init_process_group('mpicomm'): rank {me} of {backend_opts.group_size} does not match "
                f"the MPI world (rank {world.Get_rank()} of {world.Get_size()}); pass the MPI rank "
                "and size, or use mpicomm.distributed.init_process_group()")
    if ranks == list(range(world.Get_size())):
        return MpicommProcessGroup(init())
    sub = world.Create_group(world.Get_group().Incl(ranks))
    return MpicommProcessGroup(Communicator(sub, check=init().check))


def register() -> None:
    """Register the "mpicomm" backend with torch.distributed (idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def init_process_group(timeout: datetime.timedelta | None = None) -> None:
    """``dist.init_process_group("mpicomm")`` with rank and size from MPI (no rendezvous needed)."""
    register()
    world = MPI.COMM_WORLD
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(BACKEND_NAME, store=dist.HashStore(), rank=world.Get_rank(),
                            world_size=world.Get_size(), **kwargs)


def allreduce_hook(state, bucket: "dist.GradBucket") -> torch.futures.Future:
    """DDP comm hook: average the gradient bucket across ranks through mpicomm.

    ``state`` is the Communicator to use (None: the world communicator).
    """
    comm = state if isinstance(state, Communicator) else init()
    buf = bucket.buffer()
    comm.all_reduce(buf, op=ReduceOp.AVG)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


# DDP inspects the hook's annotations as objects, not the strings that postponed evaluation makes.
allreduce_hook.__annotations__["bucket"] = dist.GradBucket
allreduce_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]

register()
