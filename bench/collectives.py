"""Collectives benchmark: mpicomm vs raw mpi4py (numpy) vs torch.distributed gloo, side by side.

``mpiexec -n P python -m bench collectives [--ops ...] [--peers ...] [--sizes 8:64M] [--json F]``

Sizes follow nccl-tests: ``size`` is the whole buffer (all_reduce, broadcast), the gathered output
(all_gather), the scattered input (reduce_scatter) or each rank's send buffer (all_to_all); element
counts of the last three are rounded down to a multiple of the rank count (at least one element
per rank). Timed loops run on zero-filled buffers; correctness is checked once per measurement,
outside the timed loop, against values computed independently with numpy.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
from mpi4py import MPI

from . import common, netsim

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
PEERS = ("mpicomm", "mpi4py", "gloo")
DTYPES = ("float32", "float64", "int32", "int64")
BENCH = "collectives"

__all__ = ["OPS", "PEERS", "Case", "counts_for", "expected", "make_case", "measure",
           "available_peers", "summary_lines", "main"]


# ---------------------------------------------------------------------------------------------
# sizes and reference values

def counts_for(op: str, size_bytes: int, itemsize: int, n: int) -> tuple[int, int]:
    """Return ``(count, per_rank)``: the element count of the measured buffer and each rank's part."""
    count = max(1, size_bytes // itemsize)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        count = max(n, count - count % n)
        return count, count // n
    return count, count


def _pattern(rank: int, idx: np.ndarray) -> np.ndarray:
    """Small integers, exact in every dtype: (rank + 1) * (idx % 7 + 1)."""
    return (rank + 1) * (idx % 7 + 1)


def send_values(op: str, rank: int, count: int, per_rank: int, dtype) -> np.ndarray:
    """The check-phase send buffer of one rank."""
    length = per_rank if op == "all_gather" else count
    return _pattern(rank, np.arange(length)).astype(dtype)


def expected(op: str, rank: int, n: int, count: int, per_rank: int, dtype) -> np.ndarray:
    """The check-phase result on one rank, computed from the pattern alone."""
    ranks_sum = n * (n + 1) // 2
    if op == "all_reduce":
        return (ranks_sum * (np.arange(count) % 7 + 1)).astype(dtype)
    if op == "all_gather":
        return np.concatenate([_pattern(s, np.arange(per_rank)) for s in range(n)]).astype(dtype)
    if op == "reduce_scatter":
        idx = rank * per_rank + np.arange(per_rank)
        return (ranks_sum * (idx % 7 + 1)).astype(dtype)
    if op == "all_to_all":
        idx = rank * per_rank + np.arange(per_rank)
        return np.concatenate([_pattern(s, idx) for s in range(n)]).astype(dtype)
    if op == "broadcast":
        return _pattern(0, np.arange(count)).astype(dtype)
    raise ValueError(f"unknown op {op!r}; expected one of {OPS}")


# ---------------------------------------------------------------------------------------------
# peers

@dataclass
class Case:
    """One op on one peer at one size: the buffers and the call to time."""

    send: np.ndarray
    recv: np.ndarray
    call: Callable[[], object]
    in_place: bool  # the result lands in ``send`` (all_reduce on torch peers, broadcast)

    def result(self) -> np.ndarray:
        return self.send if self.in_place else self.recv


def _recv_len(op: str, count: int, per_rank: int) -> int:
    return {"all_reduce": count, "all_gather": count, "reduce_scatter": per_rank,
            "all_to_all": count, "broadcast": count}[op]


def make_case(peer: str, op: str, count: int, per_rank: int, dtype, mpi_comm: MPI.Comm,
              mpicomm_comm=None) -> Case:
    """Allocate zero-filled buffers and bind the collective of ``peer`` to them."""
    send_len = per_rank if op == "all_gather" else count
    send = np.zeros(send_len, dtype=dtype)
    recv = np.zeros(_recv_len(op, count, per_rank), dtype=dtype)
    if peer == "mpi4py":
        c = mpi_comm
        calls = {
            "all_reduce": lambda: c.Allreduce(send, recv, op=MPI.SUM),
            "all_gather": lambda: c.Allgather(send, recv),
            "reduce_scatter": lambda: c.Reduce_scatter_block(send, recv, op=MPI.SUM),
            "all_to_all": lambda: c.Alltoall(send, recv),
            "broadcast": lambda: c.Bcast(send, root=0),
        }
        return Case(send, recv, calls[op], in_place=op == "broadcast")
    import torch

    ts, tr = torch.from_numpy(send), torch.from_numpy(recv)
    if peer == "gloo":
        import torch.distributed as dist

        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        calls = {
            "all_reduce": lambda: dist.all_reduce(ts),
            "all_gather": lambda: ag(tr, ts),
            "reduce_scatter": lambda: rs(tr, ts),
            "all_to_all": lambda: dist.all_to_all_single(tr, ts),
            "broadcast": lambda: dist.broadcast(ts, src=0),
        }
    elif peer == "mpicomm":
        m = mpicomm_comm
        calls = {
            "all_reduce": lambda: m.all_reduce(ts),
            "all_gather": lambda: m.all_gather_into_tensor(tr, ts),
            "reduce_scatter": lambda: m.reduce_scatter_tensor(tr, ts),
            "all_to_all": lambda: m.all_to_all_single(tr, ts),
            "broadcast": lambda: m.broadcast(ts, src=0),
        }
    else:
        raise ValueError(f"unknown peer {peer!r}; expected one of {PEERS}")
    return Case(send, recv, calls[op], in_place=op in ("all_reduce", "broadcast"))


def available_peers(wanted, mpi_comm: MPI.Comm) -> tuple[list[str], dict, list[str]]:
    """Collective: ``(peers, context, notes)``: the wanted peers that work here, each skip explained."""
    peers, notes, ctx = [], [], {}
    for peer in wanted:
        if peer == "mpicomm":
            import mpicomm

            comm = mpicomm.init()
            ctx["mpicomm"] = comm
        elif peer == "gloo":
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    common.init_gloo(mpi_comm)
                ok = True
            except Exception as exc:  # noqa: BLE001 - reported as a note
                ok, why = False, f"{type(exc).__name__}: {exc}"
            if not all(mpi_comm.allgather(ok)):
                notes.append("peer gloo skipped: torch.distributed gloo did not initialise"
                             + (f" ({why})" if not ok else " on every rank"))
                continue
        elif peer != "mpi4py":
            raise ValueError(f"unknown peer {peer!r}; expected one of {PEERS}")
        peers.append(peer)
    return peers, ctx, notes


# ---------------------------------------------------------------------------------------------
# one measurement

def measure(peer: str, op: str, size_bytes: int, dtype_name: str, mpi_comm: MPI.Comm,
            info: dict, ctx: dict, iters: int | None = None, warmup: int | None = None,
            budget_s: float | None = common.DEFAULT_BUDGET_S) -> dict:
    """Collective: time one op on one peer at one size, check it, return the record."""
    n, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
    dtype = np.dtype(dtype_name)
    count, per_rank = counts_for(op, size_bytes, dtype.itemsize, n)
    nbytes = count * dtype.itemsize
    case = make_case(peer, op, count, per_rank, dtype, mpi_comm, ctx.get("mpicomm"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        meter = netsim.LinkMeter(mpi_comm)  # bytes on the simulated links (netsim only)
        meter.start()
        times, w, it = common.timed(case.call, nbytes, mpi_comm, iters=iters, warmup=warmup,
                                    budget_s=budget_s)
        measured = meter.stop(w + it)
        # correctness, outside the timed loop
        case.send[:] = send_values(op, rank, count, per_rank, dtype)
        case.recv[:] = 0
        case.call()
    want = expected(op, rank, n, count, per_rank, dtype)
    got = case.result()
    local_wrong = int(np.count_nonzero(got != want)) if got.shape == want.shape else int(want.size)
    wrong = mpi_comm.allreduce(local_wrong, op=MPI.SUM)
    algbw, busbw = common.bandwidths(nbytes, times[1], op, n)
    rec = common.make_record(
        bench=BENCH, op=op, dtype=dtype_name, size_bytes=nbytes, info=info, times_s=times,
        algbw_gbps=algbw, busbw_gbps=busbw,
        wire_bytes=int(round(nbytes * common.busbw_factor(op, n))), wrong=wrong,
        peer=peer, count=count, iters=it, warmup=w)
    if measured is not None:
        rec["wire_bytes_measured"] = measured
    return rec


def summary_lines(records: list[dict], baseline: str = "mpi4py") -> list[str]:
    """One line per op at its largest size: each peer's mean time relative to ``baseline``."""
    lines = []
    by_op: dict[str, dict[int, dict[str, dict]]] = {}
    for r in records:
        by_op.setdefault(r["op"], {}).setdefault(r["size_bytes"], {})[r.get("peer", "")] = r
    for op, sizes in by_op.items():
        size = max(sizes)
        row = sizes[size]
        base = row.get(baseline)
        parts = []
        for peer, r in row.items():
            text = f"{peer} {r['time_us_mean'] / 1e3:.3f} ms ({r['busbw_gbps']:.2f} GB/s busbw)"
            if base is not None and peer != baseline and base["time_us_mean"] > 0:
                text += f" = {r['time_us_mean'] / base['time_us_mean']:.2f}x {baseline} time"
            parts.append(text)
        lines.append(f"{op} {common.format_size(size)}: " + "; ".join(parts))
    return lines


# ---------------------------------------------------------------------------------------------
# the program

def _list_arg(choices):
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if items == ["all"]:
            return list(choices)
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"expected a comma list from {', '.join(choices)} (or 'all'), got {text!r}")
        return items
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpiexec -n P python -m bench collectives",
        description="Time collectives on mpicomm, raw mpi4py (numpy) and torch.distributed gloo.")
    common.add_common_args(parser)
    parser.add_argument("--ops", type=_list_arg(OPS), default=list(OPS),
                        help=f"comma list of ops (default all: {','.join(OPS)})")
    parser.add_argument("--peers", type=_list_arg(PEERS), default=list(PEERS),
                        help=f"comma list of peers (default all that work: {','.join(PEERS)})")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    mpi_comm = MPI.COMM_WORLD
    rep = common.Reporter(BENCH, mpi_comm, args, plot_panel="op")
    peers, ctx, notes = available_peers(args.peers, mpi_comm)
    rep.start(dtype=args.dtype, extra=[
        f"ops: {', '.join(args.ops)}; peers: {', '.join(peers) or 'none'}",
        "size = whole buffer (all_gather: output, reduce_scatter: input, all_to_all: per rank); "
        "busbw factors of nccl-tests",
    ] + notes)
    for op in args.ops:
        for size in args.sizes:
            for peer in peers:
                rep.emit(measure(peer, op, size, args.dtype, mpi_comm, rep.info, ctx,
                                 args.iters, args.warmup, args.budget))
    if rep.root and rep.records:
        for line in summary_lines(rep.records):
            rep.note(line)
    rc = rep.finish()
    _close_gloo()
    return rc


def _close_gloo() -> None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


if __name__ == "__main__":
    sys.exit(main())
