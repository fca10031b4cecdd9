"""The peers of ``bench collectives``: for each, the buffers of one op at one size and the call to
time (a ``Case``), the check of its result where it is not exact (int8, 1-bit), and which peers
can run here. Measuring them and the command line are in ``bench.collectives``.

Peers: ``mpicomm`` (the Communicator's methods), ``mpicomm-pg`` (torch.distributed's functions on
a process group of the mpicomm backend), ``mpi4py`` (numpy buffers, by hand), ``gloo``; opt-in
``mpicomm-pg-q8`` and ``mpicomm-pg-q1`` (compressed.fsdp's int8 and 1-bit collectives).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from mpi4py import MPI

from . import common, values

PEERS = ("mpicomm", "mpicomm-pg", "mpi4py", "gloo")
OPT_PEERS = ("mpicomm-pg-q8", "mpicomm-pg-q1")  # only when asked for (--peers)
Q8_BLOCK = 512
REDUCTIONS = ("all_reduce", "reduce_scatter")

__all__ = ["PEERS", "OPT_PEERS", "Q8_BLOCK", "Case", "counts_for", "make_case", "q1_wrong", "q8_wrong",
           "available_peers", "cuda_problem"]


def counts_for(op: str, size_bytes: int, itemsize: int, n: int) -> tuple[int, int]:
    """Return ``(count, per_rank)``: the element count of the measured buffer and each rank's part."""
    count = max(1, size_bytes // itemsize)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        count = max(n, count - count % n)
        return count, count // n
    return count, count


@dataclass
class Case:
    """One op on one peer at one size: host views of the buffers and the call to time."""

    send: np.ndarray                       # host form (bench.values); a view when not copied
    result: Callable[[], np.ndarray]       # the result buffer, read back to host form
    call: Callable[[], object]
    load: Callable[[np.ndarray], None]     # write check values into the send buffer
    sync: Callable[[], None] | None = None
    check: str = "exact"
    wire_factor: float = 1.0               # bytes on the wire relative to the data (2: upcast)
    keep: list = field(default_factory=list)


def _recv_len(op: str, count: int, per_rank: int) -> int:
    return per_rank if op == "reduce_scatter" else count


def _host_zeros(n: int, dtype) -> np.ndarray:
    """n zeros in memory allocated and written as the torch peers' (``torch.zeros``): numpy's own
    zeros are untouched pages (reads hit the shared zero page) and, from 4 MiB up, huge pages,
    which alone made mpi4py's 16 MiB broadcast 2.3x faster than on torch's memory here."""
    import torch

    dtype = np.dtype(dtype)
    return torch.zeros(n * dtype.itemsize, dtype=torch.uint8).numpy().view(dtype)


def _mpi4py_case(op, count, per_rank, name, c: MPI.Comm) -> Case:
    dt = values.host_dtype(name)
    send = _host_zeros(per_rank if op == "all_gather" else count, dt)
    recv = _host_zeros(_recv_len(op, count, per_rank), dt)
    if op in REDUCTIONS and name in values.SIXTEEN_BIT:
        up_in = _host_zeros(send.size, np.float32)
        up_out = _host_zeros(recv.size, np.float32)
        mpi_op = (lambda: c.Allreduce(up_in, up_out, op=MPI.SUM)) if op == "all_reduce" else \
            (lambda: c.Reduce_scatter_block(up_in, up_out, op=MPI.SUM))

        def call():  # by hand: upcast, float32 sum, one rounding back
            np.copyto(up_in, values.as_float(send, name), casting="unsafe")
            mpi_op()
            recv[:] = values.to_host(up_out, name)
        return Case(send, lambda: recv, call, lambda v: np.copyto(send, v), wire_factor=2.0)
    # 16-bit moves go as their bytes (MPI has no portable float16 type)
    s16, r16 = (send.view(np.uint16), recv.view(np.uint16)) if dt.itemsize == 2 else (send, recv)
    calls = {
        "all_reduce": lambda: c.Allreduce(send, recv, op=MPI.SUM),
        "all_gather": lambda: c.Allgather(s16, r16),
        "reduce_scatter": lambda: c.Reduce_scatter_block(send, recv, op=MPI.SUM),
        "all_to_all": lambda: c.Alltoall(s16, r16),
        "broadcast": lambda: c.Bcast(s16, root=0),
    }
    out = send if op == "broadcast" else recv
    return Case(send, lambda: out, calls[op], lambda v: np.copyto(send, v))


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _to_host(t, name: str) -> np.ndarray:
    import torch

    t = t.detach().to("cpu")
    if name == "bfloat16":
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _from_host(host: np.ndarray, name: str, device: str):
    import torch

    t = torch.from_numpy(host.view(np.int16) if name == "bfloat16" else host)
    if name == "bfloat16":
        t = t.view(torch.bfloat16)
    return t.to(device)


def _torch_case(peer, op, count, per_rank, name, device, n, mcomm) -> Case:
    import torch

    dt = _torch_dtype(name)
    ts = torch.zeros(per_rank if op == "all_gather" else count, dtype=dt, device=device)
    tr = torch.zeros(_recv_len(op, count, per_rank), dtype=dt, device=device)
    if peer == "gloo":
        import torch.distributed as api
    elif peer == "mpicomm-pg":
        api = _GroupCalls(mcomm)
    else:
        api = mcomm  # the Communicator has torch.distributed's names and arguments
    calls = {
        "all_reduce": lambda: api.all_reduce(ts),
        "all_gather": lambda: api.all_gather_into_tensor(tr, ts),
        "reduce_scatter": lambda: api.reduce_scatter_tensor(tr, ts),
        "all_to_all": lambda: api.all_to_all_single(tr, ts),
        "broadcast": lambda: api.broadcast(ts, src=0),
    }
    out = ts if op in ("all_reduce", "broadcast") else tr
    sixteen_reduce = op in REDUCTIONS and name in values.SIXTEEN_BIT
    check = f"within {n - 1} ulp" if peer == "gloo" and sixteen_reduce and n > 2 else "exact"
    sync = torch.cuda.synchronize if device == "cuda" else None
    return Case(np.zeros(0), lambda: _to_host(out, name), calls[op],
                lambda v: ts.copy_(_from_host(v, name, device)), sync=sync, check=check,
                keep=[ts, tr])


class _GroupCalls:
    """torch.distributed's functions bound to one process group (``group=``)."""

    def __init__(self, group) -> None:
        import functools

        import torch.distributed as dist

        for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                     "all_to_all_single", "broadcast"):
            setattr(self, name, functools.partial(getattr(dist, name), group=group))


def make_case(peer: str, op: str, count: int, per_rank: int, name: str, device: str,
              mpi_comm: MPI.Comm, n: int, mcomm=None) -> Case:
    """Allocate zero-filled buffers of dtype ``name`` on ``device`` and bind ``peer``'s call."""
    if peer == "mpi4py":
        return _mpi4py_case(op, count, per_rank, name, mpi_comm)
    if peer == "mpicomm-pg-q8":
        return _q8_case(op, count, per_rank, name, device, n, mcomm)
    if peer == "mpicomm-pg-q1":
        return _q1_case(op, count, per_rank, name, device, n, mcomm)
    if peer in ("mpicomm", "mpicomm-pg", "gloo"):
        return _torch_case(peer, op, count, per_rank, name, device, n, mcomm)
    raise ValueError(f"unknown peer {peer!r}; expected one of {PEERS + OPT_PEERS}")


def _q8_case(op, count, per_rank, name, device, n, group) -> Case:
    """compressed.fsdp's int8 all-gather / reduce-scatter on the mpicomm process group."""
    import torch
    import torch.distributed as dist

    from compressed.fsdp import QuantizedAllGather, QuantizedReduceScatter

    dt = _torch_dtype(name)
    ts = torch.zeros(per_rank if op == "all_gather" else count, dtype=dt, device=device)
    tr = torch.zeros(_recv_len(op, count, per_rank), dtype=dt, device=device)
    if op == "all_gather":
        ag = QuantizedAllGather(block=Q8_BLOCK)

        def call():
            return ag(tr, ts, group)
    elif op == "reduce_scatter":
        rs = QuantizedReduceScatter(block=Q8_BLOCK)

        def call():
            return rs(tr, ts, group, dist.ReduceOp.SUM)
    else:
        def call():
            raise ValueError(f"peer mpicomm-pg-q8: expected op all_gather or reduce_scatter, "
                             f"got {op}")
    if not dt.is_floating_point:
        def call():
            raise ValueError(f"peer mpicomm-pg-q8: expected a floating dtype, got {name}")
    sync = torch.cuda.synchronize if device == "cuda" else None
    wire = (1 + 4 / Q8_BLOCK) / dt.itemsize  # int8 values and one fp32 scale per block
    return Case(np.zeros(0), lambda: _to_host(tr, name), call,
                lambda v: ts.copy_(_from_host(v, name, device)), sync=sync, check="int8",
                wire_factor=wire, keep=[ts, tr])


def _q1_case(op, count, per_rank, name, device, n, group) -> Case:
    """compressed.fsdp's 1-bit reduce-scatter (error feedback) on the mpicomm process group."""
    import torch
    import torch.distributed as dist

    from compressed.fsdp import QuantizedReduceScatter

    dt = _torch_dtype(name)
    ts = torch.zeros(count, dtype=dt, device=device)
    tr = torch.zeros(per_rank, dtype=dt, device=device)
    rs = [QuantizedReduceScatter(bits=1)]   # the error state: replaced by the check's load

    def call():
        if op != "reduce_scatter":
            raise ValueError(f"peer mpicomm-pg-q1: expected op reduce_scatter, got {op}")
        if not dt.is_floating_point:
            raise ValueError(f"peer mpicomm-pg-q1: expected a floating dtype, got {name}")
        return rs[0](tr, ts, group, dist.ReduceOp.SUM)

    def load(v: np.ndarray) -> None:
        rs[0] = QuantizedReduceScatter(bits=1)      # the check starts from a zero error
        signed = values.to_host(values.as_float(v, name) * _q1_signs(v.size), name)
        ts.copy_(_from_host(signed, name, device))

    sync = torch.cuda.synchronize if device == "cuda" else None
    m8 = -(-per_rank // 8) * 8
    wire = m8 / 8 / (per_rank * dt.itemsize) + 4 / max(1, per_rank * dt.itemsize)  # signs + a scale
    return Case(np.zeros(0), lambda: _to_host(tr, name), call, load, sync=sync, check="onebit",
                wire_factor=wire, keep=[ts, tr])


def _q1_signs(length: int) -> np.ndarray:
    """The signs the 1-bit check puts on the check values (every third element negative)."""
    return np.where(np.arange(length) % 3 == 1, -1.0, 1.0)


def q1_wrong(got: np.ndarray, rank: int, n: int, per_rank: int, name: str) -> int:
    """Elements of a 1-bit reduce-scatter's result (SUM, from a zero error) off the documented
    one: each rank ``i`` sends the signs of its chunk for this rank (+1 at zero) with one scale
    ``sqrt(sum(x_i**2) / (n * m8))`` over its whole input (``m8``: the chunk rounded up to a
    multiple of 8), and this rank sums ``scale_i * sign``; fp32 rounding allowed (2**-20
    relative), then one rounding to ``name``."""
    count = n * per_rank
    m8 = -(-per_rank // 8) * 8
    want = np.zeros(per_rank)
    for i in range(n):
        x = values.as_float(values.to_host(values.as_float(values._pattern(i, np.arange(count), name),
                                                           name) * _q1_signs(count), name), name)
        scale = np.sqrt(np.sum(x.astype(np.float64) ** 2) / (n * m8))
        want += scale * np.where(x[rank * per_rank:(rank + 1) * per_rank] >= 0, 1.0, -1.0)
    rel = (2 ** -8 if name in values.SIXTEEN_BIT else 0.0) + 2 ** -20
    err = np.abs(values.as_float(got, name) - want)
    return int(np.count_nonzero(err > rel * np.abs(want)))


def q8_wrong(got: np.ndarray, op: str, rank: int, n: int, per_rank: int, name: str) -> int:
    """Elements of a quantized result off the exact one by more than the documented bound: per
    block, max|x| / 254 (relative 2**-15 more) for each peer's contribution (this rank's own
    exact), then one rounding to ``name`` (2**-8 relative for 16-bit types, 2**-23 for fp32)."""
    idx = np.arange(per_rank)
    sl = rank * per_rank + idx if op == "reduce_scatter" else idx
    want = values.expected(op, rank, n, n * per_rank, per_rank, name)
    bounds = []
    for s in range(n):
        x = np.abs(values.as_float(values._pattern(s, sl, name), name))
        pad = -len(x) % Q8_BLOCK
        amax = np.repeat(np.pad(x, (0, pad)).reshape(-1, Q8_BLOCK).max(axis=1), Q8_BLOCK)
        bounds.append(np.zeros(len(x)) if s == rank else amax[:len(x)] / 254 * (1 + 2 ** -15))
    bound = np.stack(bounds).sum(axis=0) if op == "reduce_scatter" else np.concatenate(bounds)
    w = values.as_float(want, name)
    rel = 2 ** -8 if name in values.SIXTEEN_BIT else 2 ** -23
    err = np.abs(values.as_float(got, name) - w)
    return int(np.count_nonzero(err > bound * (1 + rel) + rel * np.abs(w)))


def cuda_problem() -> str | None:
    """Why cuda rows cannot run here, or None."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device here (torch.cuda.is_available() is False)"
    return None


def available_peers(wanted, mpi_comm: MPI.Comm) -> tuple[list[str], dict, list[str]]:
    """Collective: ``(peers, context, notes)``: the wanted peers that work here, each skip explained."""
    peers, notes, ctx = [], [], {}
    # gloo first: it becomes the default group, and an mpicomm process group is then a new one
    for peer in sorted(wanted, key=lambda p: p != "gloo"):
        if peer == "mpicomm":
            import mpicomm

            ctx["mpicomm"] = mpicomm.init()
        elif peer == "gloo":
            why = ""
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    common.init_gloo(mpi_comm)
                ok = True
            except Exception as exc:  # noqa: BLE001 - reported as a note
                ok, why = False, f" ({type(exc).__name__}: {exc})"
            if not all(mpi_comm.allgather(ok)):
                notes.append(f"peer gloo skipped: torch.distributed gloo did not initialise{why}")
                continue
        elif peer in ("mpicomm-pg", "mpicomm-pg-q8", "mpicomm-pg-q1"):
            ctx[peer] = _mpicomm_group()
        elif peer != "mpi4py":
            raise ValueError(f"unknown peer {peer!r}; expected one of {PEERS + OPT_PEERS}")
        peers.append(peer)
    peers.sort(key=list(wanted).index)
    return peers, ctx, notes


def _mpicomm_group():
    """Collective: a torch.distributed process group of the mpicomm backend over all ranks (the
    default group when none exists yet, else a new group beside it)."""
    import torch.distributed as dist

    import mpicomm  # noqa: F401 - registers the backend

    if not dist.is_initialized():
        dist.init_process_group("mpicomm")
        return dist.group.WORLD
    if dist.get_backend() == "mpicomm":
        return dist.group.WORLD
    return dist.new_group(backend="mpicomm")
