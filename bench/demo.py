"""The main job: a short showcase of mpicomm (collectives vs peers, 1-bit vs fp32, a simulated network).

``mpiexec -n 2 python -m mpi4py -m bench demo`` (what ``./scripts/demo.sh`` runs). Three parts, each
of which says in one line why it is skipped when it cannot run here:

1. collectives: mpicomm vs raw mpi4py (numpy) vs torch.distributed gloo at a few sizes;
2. compressed: 1-bit compressed allreduce vs fp32 allreduce on the same ranks, with its error;
3. network: part 2 again on simulated hosts joined by 1 Gbit/s links (``bench netsim``; needs
   root, ip, tc and unshare), which is where compression pays.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable

import numpy as np
from mpi4py import MPI

from . import collectives, common, netsim

PARTS = ("collectives", "compressed", "network")
BENCH = "demo"
ROUNDS = 3


# ---------------------------------------------------------------------------------------------
# output: the parts print through ``out`` (the Reporter's ``line``: rank 0 only)

def _ms(us: float) -> str:
    return f"{us / 1e3:.3f} ms" if us >= 1000 else f"{us:.1f} us"


# ---------------------------------------------------------------------------------------------
# part 1: collectives vs peers

def part_collectives(mpi_comm, info, out: Callable[[str], None], sizes,
                     budget_s) -> list[dict]:
    """Time a few collectives on every peer that works; print one row per op and size."""
    peers, ctx, notes = collectives.available_peers(["mpicomm", "mpi4py", "gloo"], mpi_comm)
    out(f"== 1. Collectives: {' vs '.join(peers)} ({info['ranks']} ranks, float32, "
        f"median of 3 interleaved rounds per call, busbw in GB/s) ==")
    for note in notes:
        out(f"   note: {note}")
    out("   " + f"{'op':<15}{'size':>6}" + "".join(f"{p:>24}" for p in peers) + f"{'#wrong':>8}")
    records = []
    for op in ("all_reduce", "all_gather", "broadcast"):
        for size in sizes:
            row, _ = collectives.measure_size(peers, op, size, "float32", "cpu", mpi_comm, info,
                                              ctx, rounds=3, budget_s=budget_s)
            for rec in row:
                rec["bench"] = BENCH
            records += row
            cells = "".join(f"{_ms(r['time_us_mean']) + ' (%.2f)' % r['busbw_gbps']:>24}"
                            for r in row)
            out(f"   {op:<15}{common.format_size(size):>6}{cells}{sum(r['wrong'] for r in row):>8}")
    largest = [r for r in records if r["size_bytes"] >= max(sizes) // 2]
    for line in collectives.summary_lines(largest):
        out(f"   -> {line}")
    return records


# ---------------------------------------------------------------------------------------------
# part 2: 1-bit compressed vs fp32 allreduce

def make_onebit(mcomm):
    """Return ``(fn(tensor) -> mean tensor, description)``: compressed.OnebitAllreduce."""
    import compressed

    ar = compressed.OnebitAllreduce(mcomm)
    return (lambda t: ar(t, key=f"demo-{t.numel()}")), "compressed.OnebitAllreduce"


def onebit_error(fn, mpi_comm, numel: int, calls: int) -> tuple[float, float]:
    """Relative error vs the exact mean: of one call, and of the average of ``calls`` calls."""
    import torch

    n, rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
    gen = torch.Generator().manual_seed(1234 + rank)
    g = torch.randn(numel, generator=gen)
    exact = np.empty(numel, dtype=np.float64)
    mpi_comm.Allreduce(g.double().numpy(), exact, op=MPI.SUM)
    exact /= n
    total = np.zeros(numel)
    first = None
    for i in range(calls):
        got = fn(g.clone()).double().numpy()
        total += got
        if i == 0:
            first = got.copy()
    norm = np.linalg.norm(exact)
    one = mpi_comm.allreduce(float(np.linalg.norm(first - exact) / norm), op=MPI.MAX)
    avg = mpi_comm.allreduce(float(np.linalg.norm(total / calls - exact) / norm), op=MPI.MAX)
    return one, avg


def part_compressed(mpi_comm, info, out, size_bytes: int, iters: int, warmup: int,
                    title: str) -> list[dict]:
    """Time fp32 allreduce and 1-bit compressed allreduce of one buffer; print the ratio."""
    import torch

    import mpicomm

    mcomm = mpicomm.init()
    n = mpi_comm.Get_size()
    numel = size_bytes // 4
    out(f"== {title} ==")
    fp32, fp32_name = (lambda t: mcomm.all_reduce(t)), "mpicomm"
    onebit, onebit_name = make_onebit(mcomm)
    records = []
    # timed in 3 interleaved rounds (fp32 on zeros, in place, so values stay put; 1-bit on noise)
    t = torch.zeros(numel)
    g = torch.randn(numel, generator=torch.Generator().manual_seed(mpi_comm.Get_rank()))
    calls = {"fp32": lambda: fp32(t), "onebit": lambda: onebit(g)}
    rounds: dict[str, list] = {k: [] for k in calls}
    sent: dict[str, list] = {k: [] for k in calls}
    meter = netsim.LinkMeter(mpi_comm)  # bytes on the simulated links (under netsim only)
    for r in range(ROUNDS):
        for key in (["fp32", "onebit"] if r % 2 == 0 else ["onebit", "fp32"]):
            meter.start()
            timing = common.timed(calls[key], size_bytes, mpi_comm, iters=iters, warmup=warmup)
            sent[key].append(meter.stop(timing[1] + timing[2]))
            rounds[key].append(timing)

    def record(key, peer, wire, wrong, **extra):
        times, means = common.median_round([x[0] for x in rounds[key]])
        mid = means.index(times[1])
        algbw, busbw = common.bandwidths(size_bytes, times[1], "all_reduce", n)
        rec = common.make_record(
            bench=BENCH, op="all_reduce", dtype="float32", size_bytes=size_bytes, info=info,
            times_s=times, algbw_gbps=algbw, busbw_gbps=busbw, wire_bytes=wire, wrong=wrong,
            round_means_s=means, peer=peer, iters=rounds[key][mid][2],
            warmup=rounds[key][mid][1], **extra)
        if meter.enabled:
            rec["wire_bytes_measured"] = sent[key][mid]
        records.append(rec)
        return rec

    # fp32 checked exactly on a pattern
    check = torch.full((numel,), float(mpi_comm.Get_rank() + 1))
    fp32(check)
    wrong = mpi_comm.allreduce(int((check != n * (n + 1) / 2).sum()), op=MPI.SUM)
    fp32_rec = record("fp32", f"fp32-{fp32_name}",
                      int(size_bytes * common.busbw_factor("all_reduce", n)), wrong)
    out(f"   fp32 allreduce ({fp32_name}) of {common.format_size(size_bytes)}: "
        f"{_ms(fp32_rec['time_us_mean'])} per call (busbw {fp32_rec['busbw_gbps']:.3f} GB/s, "
        f"#wrong {wrong})")
    # one fresh 1-bit call against a float64 simulation built on plain allreduce (identity on 1 rank)
    from .compressed import check_onebit

    sample = g[:min(numel, 1 << 18)].clone()
    if n == 1:
        wrong = int((onebit(sample.clone()) != sample).sum())
    else:
        wrong = check_onebit(sample.numpy(), mpi_comm, new=True)
    one, avg = onebit_error(onebit, mpi_comm, min(numel, 1 << 18), calls=8)
    # sign bits out and back (all-to-all then allgather), each (n-1)/n of numel/8 bytes
    wire = int(2 * (n - 1) / n * numel / 8) if n > 1 else 0
    rec = record("onebit", "onebit", wire, wrong, rel_error_1call=one, rel_error_avg8=avg)
    speedup = fp32_rec["time_us_mean"] / rec["time_us_mean"] if rec["time_us_mean"] else 0.0
    out(f"   1-bit compressed allreduce ({onebit_name}): {_ms(rec['time_us_mean'])} per call, "
        + (f"{speedup:.1f}x faster than fp32" if speedup >= 1
           else f"{1 / speedup:.1f}x slower than fp32" if speedup > 0 else "")
        + f" (medians of {ROUNDS} interleaved rounds; #wrong {wrong} vs a float64 simulation)")
    if meter.enabled and rec.get("wire_bytes_measured"):
        out(f"   counted on the links per rank and call: fp32 "
            f"{fp32_rec['wire_bytes_measured']:.0f} B, 1-bit {rec['wire_bytes_measured']:.0f} B = "
            f"{fp32_rec['wire_bytes_measured'] / rec['wire_bytes_measured']:.1f}x fewer")
    out(f"   error vs the exact mean: {one:.2f} for one call, {avg:.3f} for the average of 8 "
        f"calls (error feedback carries what one call drops)")
    return records


# ---------------------------------------------------------------------------------------------
# part 3: the same on simulated hosts

def _wait_quietly(mpi_comm) -> None:
    """Barrier that sleeps instead of spinning, so waiting ranks leave the CPUs to others."""
    req = mpi_comm.Ibarrier()
    while not req.Test():
        time.sleep(0.05)


def part_network(mpi_comm, out, rates: list[str], size_bytes: int, timeout_s: float) -> list[dict]:
    """Rank 0 runs part 2 under ``bench netsim`` (2 hosts) at each rate; the others wait."""
    out(f"== 3. Simulated network: 2 hosts (network namespaces), {', '.join(rates)} links, "
        f"one rank per host ==")
    records: list[dict] = []
    if mpi_comm.Get_rank() == 0:
        problem = netsim.preflight()
        if problem is None and MPI.get_vendor()[0] not in ("MPICH", "Open MPI"):
            problem = f"netsim launches with MPICH or Open MPI; this MPI is {MPI.get_vendor()[0]}"
        if problem:
            out(f"   skipped: {problem}")
        for rate in rates if not problem else []:
            with tempfile.TemporaryDirectory(prefix="mpicomm-demo-") as tmp:
                path = os.path.join(tmp, "net.json")
                cmd = [sys.executable, "-m", "bench", "netsim", "--hosts", "2", "--rate", rate,
                       "--timeout", str(timeout_s), "--", "demo", "--parts", "compressed",
                       "--compressed-size", common.format_size(size_bytes), "--json", path]
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, env=common.clean_env(),
                                      timeout=timeout_s + 60)
                took = time.perf_counter() - t0
                recs = []
                if os.path.exists(path):
                    with open(path) as f:
                        recs = json.load(f)["records"]
            if proc.returncode != 0 or not recs:
                tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-3:]
                out(f"   {rate}: failed (exit {proc.returncode}): {' | '.join(tail)}")
                continue
            for line in proc.stdout.splitlines():
                if line.startswith("   "):
                    out(f"   [{rate}]{line[2:]}")
            out(f"   [{rate}] (set-up, run and tear-down took {took:.1f} s)")
            records += recs
    _wait_quietly(mpi_comm)
    return mpi_comm.bcast(records, root=0)


# ---------------------------------------------------------------------------------------------
# summary

def summary(records: list[dict]) -> list[str]:
    """The headline of each part that ran, one line each."""
    lines = []
    coll = [r for r in records if r["op"] == "all_reduce" and r.get("peer") in collectives.PEERS]
    if coll:
        size = max(r["size_bytes"] for r in coll)
        at = {r["peer"]: r for r in coll if r["size_bytes"] == size}
        base = at.get("mpi4py")
        parts = [f"{peer} {_ms(r['time_us_mean'])}"
                 + (f" ({r['time_us_mean'] / base['time_us_mean']:.2f}x mpi4py)"
                    if base and peer != "mpi4py" and base["time_us_mean"] > 0 else "")
                 for peer, r in at.items()]
        lines.append(f"all_reduce {common.format_size(size)}, local: " + ", ".join(parts))
    by_network: dict[str, dict[str, dict]] = {}
    for r in records:
        peer = r.get("peer", "")
        if peer == "onebit" or peer.startswith("fp32-"):
            by_network.setdefault(r["network"], {})["onebit" if peer == "onebit" else "fp32"] = r
    for network, pair in by_network.items():
        fp32, onebit = pair.get("fp32"), pair.get("onebit")
        where = "local" if network == "local" else network.replace("netsim: ", "")
        size = common.format_size((fp32 or onebit)["size_bytes"])
        if fp32 and onebit and onebit["time_us_mean"] > 0:
            ratio = fp32["time_us_mean"] / onebit["time_us_mean"]
            verdict = f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower"
            lines.append(f"1-bit vs fp32 allreduce of {size}, {where}: {_ms(onebit['time_us_mean'])}"
                         f" vs {_ms(fp32['time_us_mean'])}, {verdict}")
        elif fp32:
            lines.append(f"fp32 allreduce of {size}, {where}: {_ms(fp32['time_us_mean'])} "
                         f"(1-bit not available)")
    return lines


# ---------------------------------------------------------------------------------------------
# the program

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpiexec -n 2 python -m bench demo",
        description="A short showcase: collectives vs peers, 1-bit vs fp32, simulated network.")
    parser.add_argument("--parts", type=common.comma_list(PARTS, all_word=False),
                        default=list(PARTS),
                        help=f"comma list of parts to run (default {','.join(PARTS)})")
    parser.add_argument("--sizes", type=common.parse_sizes, default=common.parse_sizes("4K,1M,16M"),
                        help="sizes for part 1 (default 4K,1M,16M)")
    parser.add_argument("--compressed-size", type=common.parse_size, default=64 << 20,
                        help="buffer size for parts 2 and 3 (default 64M)")
    parser.add_argument("--rates", type=common.comma_list(), default=["1gbit"],
                        help="comma list of link rates for part 3 (default 1gbit; e.g. 1gbit,10gbit)")
    parser.add_argument("--budget", type=float, default=0.3,
                        help="seconds per measurement in part 1 (default 0.3)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write every measurement as a JSON record to FILE")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    parts = args.parts
    mpi_comm = MPI.COMM_WORLD
    rep = common.Reporter(BENCH, mpi_comm, args, narrative=True)
    out = rep.line
    info = rep.start(dtype="float32", iterations="see each part", meta={"parts": parts})
    t0 = time.perf_counter()
    if parts != ["compressed"] or info["network"] == "local":
        out(f"mpicomm demo: {info['ranks']} ranks on {info['hosts']} host(s), "
            f"{info['mpi_vendor']} {info['mpi_version']}, mpi4py {info['mpi4py_version']}, "
            f"torch {info['torch_version']}; network: {info['network']}")
        out()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for part in PARTS:
            if part in parts:
                for rec in _run_part(part, args, mpi_comm, info, out):
                    rep.emit(rec)
                out()
    collectives.close_gloo()
    if parts != ["compressed"] or info["network"] == "local":
        lines = summary(rep.records)
        if lines:
            out("== Summary ==")
            for line in lines:
                out(f"   {line}")
            out()
        out(f"demo done in {time.perf_counter() - t0:.1f} s; "
            + ("all values correct" if rep.wrong == 0 else f"FAILED: {rep.wrong} wrong values"))
    return rep.finish()


def _run_part(part: str, args, mpi_comm, info: dict, out: Callable[[str], None]) -> list[dict]:
    """The records of one part of the demo (it prints as it goes)."""
    if part == "collectives":
        return part_collectives(mpi_comm, info, out, args.sizes, args.budget)
    if part == "compressed":
        title = ("2. Compressed: 1-bit allreduce vs fp32 allreduce, "
                 f"{info['ranks']} ranks, {info['network']}")
        return part_compressed(mpi_comm, info, out, args.compressed_size, iters=3, warmup=1,
                               title=title)
    return part_network(mpi_comm, out, args.rates, args.compressed_size, timeout_s=120)


if __name__ == "__main__":
    sys.exit(main())
