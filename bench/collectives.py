"""Collectives benchmark: mpicomm vs raw mpi4py (numpy) vs torch.distributed gloo, side by side.

``mpiexec -n P python -m bench collectives [--ops ...] [--peers ...] [--dtype float32 bfloat16 ...]
[--device cpu cuda] [--sizes 8:64M] [--rounds 3] [--json F] [--plot F.png]``

Sizes follow nccl-tests: ``size`` is the whole buffer (all_reduce, broadcast), the gathered output
(all_gather), the scattered input (reduce_scatter) or each rank's send buffer (all_to_all); element
counts of the last three are rounded down to a multiple of the rank count (at least one element
per rank). Each size is timed in ``--rounds`` rounds, the peers interleaved within each round
(their order rotating), on zero-filled buffers; the record is the median round, with the fastest
and slowest round beside it. Correctness is checked once per measurement, outside the timed
loops, against values computed in numpy (``bench.values``).

Peers: ``mpicomm`` (the Communicator's methods), ``mpicomm-pg`` (torch.distributed's functions on
a process group of the mpicomm backend: what a torch user calls), ``mpi4py`` and ``gloo``.
Opt-in peer ``mpicomm-pg-q8`` (all_gather and reduce_scatter only): ``compressed.fsdp``'s
``QuantizedAllGather`` / ``QuantizedReduceScatter`` on that process group, called as FSDP2 calls
them (blocking), checked against the documented int8 error bound per block of 512 elements;
``--peers mpicomm-pg,mpicomm-pg-q8`` times it beside FSDP2's own collective. Opt-in peer
``mpicomm-pg-q1`` (reduce_scatter only): ``QuantizedReduceScatter(bits=1)``, its error feedback
carried from call to call as in training; checked on a fresh error against the documented 1-bit
result (one scale per rank, the signs of its chunks), on check values of mixed signs.

The mpi4py peer is what a user would write by hand: numpy buffers (on memory allocated and
written as the torch peers', so that all peers move the same kind of pages); for float16/bfloat16
reductions an upcast to float32, MPI's float32 sum and one rounding back. gloo reduces 16-bit
types its own way, so its 16-bit reductions are checked to within n-1 units in the last place.

Where the parts live: ``bench.collective_peers`` (each peer's buffers and call, the int8 and 1-bit
checks, which peers run here); here measuring one size on every peer, the summary and ``main``.
"""
from __future__ import annotations

import argparse
import sys
import warnings

import numpy as np
from mpi4py import MPI

from . import common, netsim, values
from .collective_peers import (OPT_PEERS, PEERS, Case, available_peers, counts_for, cuda_problem, make_case,
                               q1_wrong, q8_wrong)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
DTYPES = values.DTYPES
DEVICES = ("cpu", "cuda")
BENCH = "collectives"

__all__ = ["OPS", "PEERS", "DTYPES", "DEVICES", "Case", "counts_for", "make_case",
           "measure_size", "available_peers", "cuda_problem", "summary_lines", "main"]


# ---------------------------------------------------------------------------------------------
# one size, every peer, in interleaved rounds

def _probe(case: Case, mpi_comm: MPI.Comm) -> str | None:
    """Collective: call once; the first rank's error when the peer cannot do this on any rank."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            case.call()
        err = None
    except Exception as exc:  # noqa: BLE001 - a peer that cannot do a dtype/op is a note
        err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    errors = [e for e in mpi_comm.allgather(err) if e]
    return errors[0] if errors else None


def measure_size(peers, op: str, size_bytes: int, name: str, device: str, mpi_comm: MPI.Comm,
                 info: dict, ctx: dict, *, rounds: int = 3, iters: int | None = None,
                 warmup: int | None = None,
                 budget_s: float | None = common.DEFAULT_BUDGET_S) -> tuple[list[dict], list[str]]:
    """Collective: time ``op`` on every peer at one size in interleaved rounds, check each once.

    Returns ``(records, notes)``: one record per peer (the median round, with the fastest and
    slowest), and a note for each peer that cannot run this op/dtype/device.
    """
    n, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
    itemsize = values.host_dtype(name).itemsize
    count, per_rank = counts_for(op, size_bytes, itemsize, n)
    nbytes = count * itemsize
    cases, notes = {}, []
    for peer in peers:
        if peer == "mpi4py" and device != "cpu":
            notes.append(f"peer mpi4py skipped on {device}: it times numpy host buffers")
            continue
        case = make_case(peer, op, count, per_rank, name, device, mpi_comm, n, ctx.get(peer))
        problem = _probe(case, mpi_comm)
        if problem:
            notes.append(f"peer {peer} skipped for {op} {name} on {device}: {problem}")
            continue
        cases[peer] = case
    timings: dict[str, list] = {p: [] for p in cases}
    measured: dict[str, list] = {p: [] for p in cases}
    order = list(cases)
    per_round = budget_s / rounds if budget_s else budget_s
    meter = netsim.LinkMeter(mpi_comm)  # bytes on the simulated links (under netsim only)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for r in range(rounds):
            for peer in order[r % len(order):] + order[:r % len(order)] if order else []:
                c = cases[peer]
                meter.start()
                timing = common.timed(c.call, nbytes, mpi_comm, iters=iters, warmup=warmup,
                                      budget_s=per_round, sync=c.sync)
                measured[peer].append(meter.stop(timing[1] + timing[2]))
                timings[peer].append(timing)
        records = []
        for peer, case in cases.items():
            case.load(values.send_values(op, rank, count, per_rank, name))
            case.call()
            if case.sync is not None:
                case.sync()
            want = values.expected(op, rank, n, count, per_rank, name)
            ulps = n - 1 if case.check != "exact" else 0
            if case.check == "int8":
                local = q8_wrong(np.asarray(case.result()), op, rank, n, per_rank, name)
            elif case.check == "onebit":
                local = q1_wrong(np.asarray(case.result()), rank, n, per_rank, name)
            else:
                local = values.count_wrong(np.asarray(case.result()), want, name, ulps)
            wrong = mpi_comm.allreduce(local, op=MPI.SUM)
            times, round_means = common.median_round([t[0] for t in timings[peer]])
            mid = round_means.index(times[1])
            _, w, it = timings[peer][mid]
            algbw, busbw = common.bandwidths(nbytes, times[1], op, n)
            wire = int(round(nbytes * common.busbw_factor(op, n) * case.wire_factor))
            rec = common.make_record(
                bench=BENCH, op=op, dtype=name, size_bytes=nbytes, info=info, times_s=times,
                algbw_gbps=algbw, busbw_gbps=busbw, wire_bytes=wire, wrong=wrong,
                round_means_s=round_means, peer=peer, count=count, device=device, iters=it,
                warmup=w, check=case.check)
            if meter.enabled:  # the median round's count
                rec["wire_bytes_measured"] = measured[peer][mid]
            records.append(rec)
    return records, notes


def summary_lines(records: list[dict]) -> list[str]:
    """One line per op, dtype and device at its largest size: each peer's median time, with the
    rounds' spread, relative to mpi4py (or to gloo where mpi4py did not run)."""
    groups: dict[tuple, dict[int, dict[str, dict]]] = {}
    for r in records:
        key = (r["op"], r["dtype"], r.get("device", "cpu"))
        groups.setdefault(key, {}).setdefault(r["size_bytes"], {})[r.get("peer", "")] = r
    lines = []
    for (op, name, device), sizes in groups.items():
        size = max(sizes)
        row = sizes[size]
        base_name = next((b for b in ("mpi4py", "gloo") if b in row), None)
        base = row.get(base_name) if base_name else None
        parts = []
        for peer, r in row.items():
            lo, hi = r.get("time_us_round_min"), r.get("time_us_round_max")
            spread = f" [{lo / 1e3:.3f}-{hi / 1e3:.3f}]" if lo is not None else ""
            text = f"{peer} {r['time_us_mean'] / 1e3:.3f} ms{spread}"
            if base is not None and peer != base_name and base["time_us_mean"] > 0:
                text += f" = {r['time_us_mean'] / base['time_us_mean']:.2f}x {base_name}"
            parts.append(text)
        lines.append(f"{op} {name} {device} {common.format_size(size)}: " + "; ".join(parts))
    return lines


# ---------------------------------------------------------------------------------------------
# the program

COLUMNS = common.columns(
    "op", "peer", "size_bytes", "count", "dtype", "device",
    common.Column("time_us_mean", "time(us)", 11, ".1f"),   # the median round's
    "time_us_round_min", "time_us_round_max", "algbw_gbps", "busbw_gbps", "wrong")


def _flat(lists) -> list[str]:
    return list(dict.fromkeys(x for sub in lists for x in sub))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpiexec -n P python -m bench collectives",
        description="Time collectives on mpicomm, raw mpi4py (numpy) and torch.distributed gloo.")
    common.add_common_args(parser)
    common.add_rounds_arg(parser)
    parser.add_argument("--ops", type=common.comma_list(OPS), default=list(OPS),
                        help=f"comma list of ops (default all: {','.join(OPS)})")
    parser.add_argument("--peers", type=common.comma_list(PEERS + OPT_PEERS), default=list(PEERS),
                        help=f"comma list of peers (default all that work: {','.join(PEERS)}; "
                             f"opt-in: {','.join(OPT_PEERS)})")
    parser.add_argument("--dtype", type=common.comma_list(DTYPES), nargs="+", default=[["float32"]],
                        metavar="DTYPE", help=f"one or more of {', '.join(DTYPES)} (spaces or "
                                              "commas; default float32)")
    parser.add_argument("--device", type=common.comma_list(DEVICES), nargs="+", default=[["cpu"]],
                        metavar="DEVICE", help="cpu and/or cuda (cuda rows are skipped with a "
                                               "note where there is no GPU; default cpu)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    dtypes, devices = _flat(args.dtype), _flat(args.device)
    mpi_comm = MPI.COMM_WORLD
    rep = common.Reporter(BENCH, mpi_comm, args, COLUMNS)
    peers, ctx, notes = available_peers(args.peers, mpi_comm)
    if "cuda" in devices:
        problem = mpi_comm.bcast(cuda_problem(), root=0)
        if problem:
            notes.append(f"cuda rows skipped: {problem}")
            devices = [d for d in devices if d != "cuda"]
    rep.start(dtype=", ".join(dtypes), extra=[
        f"ops: {', '.join(args.ops)}; peers: {', '.join(peers) or 'none'}; "
        f"devices: {', '.join(devices) or 'none'}",
        "size = whole buffer (all_gather: output, reduce_scatter: input, all_to_all: per rank); "
        "busbw factors of nccl-tests",
        f"time = median of {args.rounds} interleaved round(s) (each the mean over ranks of the "
        "per-call time); min/max = fastest/slowest round",
        "16-bit reductions: checked against a float32 sum rounded once (mpicomm's semantics)",
    ] + notes)
    seen = set(notes)
    for op in args.ops:
        for name in dtypes:
            for device in devices:
                for size in args.sizes:
                    recs, new = measure_size(peers, op, size, name, device, mpi_comm, rep.info,
                                             ctx, rounds=args.rounds, iters=args.iters,
                                             warmup=args.warmup, budget_s=args.budget)
                    for line in new:
                        if line not in seen:
                            seen.add(line)
                            rep.note(line)
                    for rec in recs:
                        rep.emit(rec)
    if rep.root and rep.records:
        for line in summary_lines(rep.records):
            rep.note(line)
    rc = rep.finish()
    close_gloo()
    return rc


def close_gloo() -> None:
    """Leave the gloo group if one was joined (best effort, at exit)."""
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


if __name__ == "__main__":
    sys.exit(main())
