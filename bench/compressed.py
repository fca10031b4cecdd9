"""1-bit compressed allreduce benchmark: compressed vs fp32 MPI Allreduce, kernels vs memcpy.

``mpiexec -n P python -m bench compressed [--sizes 1K:64M] [--iters N] [--json F] [--plot F]``

For every size (bytes of float32 input per rank) it measures, side by side in one run:

- ``all_reduce``           the plain fp32 MPI Allreduce (mpi4py, numpy buffers): the baseline;
- ``all_reduce:1bit``      ``compressed.MpiBackend.compressed_allreduce`` (error feedback kept);
- ``compress`` (local)     the worker compression kernels of ``MpiBackend``: x = g + e, sum of
                           squares (the scale), signs packed, then the error update
                           e = x - scale * sign(x) (DeepSpeed's buffers: two passes);
- ``encode`` (local)       the first of them alone: sign + sum of squares + pack;
- ``decompress`` (local)   unpacking p chunks of signs times their scales into the output;
- ``memcpy`` (local)       numpy copy of the same buffer, the memory-bandwidth yardstick.

Opt-in rows (``--ops``; ``OnebitAllreduce``, which owns its error buffers and defers updates):

- ``all_reduce:1bit-ar``   ``compressed.OnebitAllreduce.allreduce_`` (in place, like the row above),
                           hierarchical or flat as the default decides (several nodes with
                           several ranks each: hierarchical);
- ``all_reduce:1bit-flat`` the same with ``hierarchical=False`` (the flat algorithm);
- ``all_reduce:1bit-hier`` the same with ``hierarchical=True`` (refused on one node, one rank per
                           node or uneven nodes);
- ``all_reduce:1bit-new``  ``compressed.OnebitAllreduce.__call__`` (returns a new tensor);
- ``compress:fused``       its worker compression kernel, one pass: the previous call's error
                           update (x_prev - scale_prev * sign(x_prev)) + g into the spare buffer,
                           sum of squares, signs packed (``kernels.encode_into``), buffers swapped.
- ``server`` (local)       the server step of one rank (both APIs): p rows of signs of its
                           chunk times their scales, plus the server error, summed into the
                           server buffer, its signs packed (``kernels.server_accumulate``);
                           compare with memcpy at size / p.

``x_fp32`` is each row's time over the fp32 allreduce's; ``wire(B)`` the bytes one rank sends
(ring allreduce: 2(p-1)/p * size; compressed: both phases' messages, plus the full-precision
messages inside the node when hierarchical). Correctness is checked once per size outside the
timed loops: the fp32 sum against its known value, and the compressed result against a float64
simulation built on plain allreduce (hierarchical: the node's mean, then the flat simulation
across nodes; positions whose compensated server value is within float noise of zero are not
counted). Under ``bench netsim`` the rows also get the bytes counted on the simulated links.

``--crossover``: see ``bench.crossover`` (fp32 against each 1-bit API over sizes, the size from
which 1-bit is faster, here and on netsim at each ``--rates``).
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np
from mpi4py import MPI

from . import common, netsim

BENCH = "compressed"

COLUMNS = common.columns(
    common.Column("op", "op", 19),   # all_reduce:1bit-new
    "peer", "size_bytes", "count", "time_us_min", "time_us_mean", "time_us_max", "algbw_gbps",
    "busbw_gbps", common.Column("x_fp32", "x_fp32", 8, ".3f"), "wire_bytes", "wrong")

__all__ = ["main", "simulate_compressed", "check_compressed"]


def simulate_compressed(g: np.ndarray, mpi_comm: MPI.Comm,
                        hierarchy=None) -> tuple[np.ndarray, np.ndarray]:
    """Float64 simulation of one compressed allreduce with zero errors: (output, compensated s).

    ``hierarchy`` (a ``compressed.hierarchical.Hierarchy``, enabled): the node's mean, this
    rank's part of it compressed across nodes, parts gathered in the node (its documented
    semantics); only its node membership is taken from it."""
    if hierarchy is not None and hierarchy.enabled:
        node, cross = hierarchy.node.mpi_comm, hierarchy.cross.mpi_comm
        L, n = node.Get_size(), g.size
        padded = -(-n // (8 * mpi_comm.Get_size())) * 8 * mpi_comm.Get_size()
        sub = padded // L
        x = np.zeros(padded)
        x[:n] = g
        mean = np.empty(padded)
        node.Allreduce(x / L, mean, op=MPI.SUM)
        j = node.Get_rank()
        out_part, s_part = simulate_compressed(mean[j * sub:(j + 1) * sub], cross)
        out, s_all = np.empty(padded), np.empty(padded)
        node.Allgather(np.ascontiguousarray(out_part), out)
        node.Allgather(np.ascontiguousarray(s_part), s_all)
        return out[:n], s_all[:n]
    p, r = mpi_comm.Get_size(), mpi_comm.Get_rank()
    n = g.size
    N = -(-n // (8 * p)) * 8 * p
    x = np.zeros(N)
    x[:n] = g
    scale = np.linalg.norm(x) / math.sqrt(N)
    mean = np.empty(N)
    mpi_comm.Allreduce(np.where(x >= 0, scale, -scale) / p, mean, op=MPI.SUM)
    chunk = N // p
    s = mean[r * chunk:(r + 1) * chunk]
    sscale = np.linalg.norm(s) / math.sqrt(chunk)
    out = np.empty(N)
    mpi_comm.Allgather(np.where(s >= 0, sscale, -sscale), out)
    s_all = np.empty(N)
    mpi_comm.Allgather(np.ascontiguousarray(s), s_all)
    return out[:n], s_all[:n]


def check_compressed(backend, g: np.ndarray, mpi_comm: MPI.Comm) -> int:
    """Collective: positions where a fresh compressed allreduce of ``g`` disagrees with the simulation."""
    import torch

    import compressed

    p = mpi_comm.Get_size()
    N = compressed.padded_size(g.size, p)
    we = torch.zeros(N)
    se = torch.zeros(N // p)
    out = backend.compressed_allreduce(torch.from_numpy(g.copy()), we, se, 0).numpy().astype(np.float64)
    want, s = simulate_compressed(g.astype(np.float64), mpi_comm, backend.hierarchy)
    near0 = np.abs(s) <= 1e-5 * (np.abs(s).max() + 1e-30)
    bad = (np.abs(out - want) > 2e-6 * np.abs(want) + 1e-30) & ~near0
    return int(mpi_comm.allreduce(int(bad.sum()), op=MPI.SUM))


def check_onebit(g: np.ndarray, mpi_comm: MPI.Comm, new: bool, kernels: str | None = None,
                 hierarchical: bool | None = None) -> int:
    """Collective: positions where a fresh ``OnebitAllreduce`` of ``g`` disagrees with the simulation."""
    import torch

    import compressed

    ar = compressed.OnebitAllreduce(mpi_comm, kernels=kernels, hierarchical=hierarchical)
    t = torch.from_numpy(g.copy())
    out = (ar(t, key="check") if new else ar.allreduce_(t, key="check")).numpy().astype(np.float64)
    want, s = simulate_compressed(g.astype(np.float64), mpi_comm, ar.compressor.hierarchy)
    near0 = np.abs(s) <= 1e-5 * (np.abs(s).max() + 1e-30)
    bad = (np.abs(out - want) > 2e-6 * np.abs(want) + 1e-30) & ~near0
    return int(mpi_comm.allreduce(int(bad.sum()), op=MPI.SUM))


def _cases(ops, g, lay, world, backend, onebit, fam, kernels, rng) -> dict:
    """op -> (callable, peer, wire bytes per rank, correctness check or None), in table order."""
    import torch

    from compressed.wire_format import fp32_allreduce_wire_bytes

    p = world.Get_size()

    def msg():  # one message of signs per rank, in the family's kind of array
        return fam.view(torch.empty((p, lay.chunk_bytes), dtype=torch.uint8))

    def f32(init=None):
        t = torch.zeros(init) if isinstance(init, int) else torch.from_numpy(init.copy())
        return fam.view(t)

    gk = f32(g)
    n = g.size
    cases: dict = {}
    if "all_reduce" in ops:
        src = np.full(n, world.Get_rank() + 1, np.float32)
        dst = np.empty_like(src)

        def check_sum() -> int:
            world.Allreduce(src, dst, op=MPI.SUM)
            return int(world.allreduce(int(np.count_nonzero(dst != p * (p + 1) / 2)), op=MPI.SUM))

        cases["all_reduce"] = (lambda: world.Allreduce(src, dst, op=MPI.SUM), "mpi4py",
                               fp32_allreduce_wire_bytes(n, p), check_sum)
    if "all_reduce:1bit" in ops:
        we, se, buf = torch.zeros(lay.padded), torch.zeros(lay.chunk), torch.from_numpy(g.copy())
        cases["all_reduce:1bit"] = (lambda: backend.compressed_allreduce(buf, we, se, 0), "mpicomm",
                                    backend.call_wire_bytes(n), lambda: check_compressed(backend, g, world))
    if "compress" in ops:
        we2, msg2 = f32(lay.padded), msg()

        def compress() -> None:
            ssq = fam.encode(gk, we2, msg2)
            fam.worker_residual(gk, we2, math.sqrt(ssq / lay.padded))

        cases["compress"] = (compress, "local", 0, None)
    for op, hier in (("all_reduce:1bit-flat", False), ("all_reduce:1bit-hier", True)):
        if op in ops:
            arh = onebit[hier]
            th = torch.from_numpy(g.copy())
            cases[op] = (lambda a=arh, t=th: a.allreduce_(t, key=f"ar_{n}"), "mpicomm",
                         arh.compressor.call_wire_bytes(n),
                         lambda h=hier: check_onebit(g, world, False, kernels, h))
    if "all_reduce:1bit-ar" in ops or "all_reduce:1bit-new" in ops:
        ar = onebit[None]
        t = torch.from_numpy(g.copy())
        if "all_reduce:1bit-ar" in ops:
            cases["all_reduce:1bit-ar"] = (lambda: ar.allreduce_(t, key=f"ar_{n}"), "mpicomm",
                                           ar.compressor.call_wire_bytes(n),
                                           lambda: check_onebit(g, world, False, kernels))
        if "all_reduce:1bit-new" in ops:
            cases["all_reduce:1bit-new"] = (lambda: ar(t, key=f"new{n}"), "mpicomm",
                                            ar.compressor.call_wire_bytes(n),
                                            lambda: check_onebit(g, world, True, kernels))
    if "compress:fused" in ops:
        # torch-allocated (64-byte aligned) like OnebitAllreduce's buffers
        fused = {"e": f32(lay.padded), "x": f32(lay.padded), "pending": 0.0}
        msg4 = msg()

        def compress_fused() -> None:
            ssq = fam.encode(gk, fused["e"], msg4, fused["x"], fused["pending"])
            fused["pending"] = float(np.float32(math.sqrt(ssq / lay.padded)))
            fused["e"], fused["x"] = fused["x"], fused["e"]

        cases["compress:fused"] = (compress_fused, "local", 0, None)
    if "encode" in ops:
        we3, msg3 = f32(lay.padded), msg()
        cases["encode"] = (lambda: fam.encode(gk, we3, msg3), "local", 0, None)
    if "decompress" in ops:
        rows = fam.view(torch.from_numpy(rng.integers(0, 256, (p, lay.chunk_bytes), dtype=np.uint8)))
        scales = np.ones(p, np.float32)
        out = f32(n)
        cases["decompress"] = (lambda: fam.decode(rows, scales, out), "local", 0, None)
    if "server" in ops:
        srows = fam.view(torch.from_numpy(rng.integers(0, 256, (p, lay.chunk_bytes), dtype=np.uint8)))
        coef = np.full(p, 1.0 / p, np.float32)
        sbuf, sbits = f32(lay.chunk), fam.view(torch.empty(lay.chunk_bytes, dtype=torch.uint8))
        cases["server"] = (lambda: fam.server_accumulate(srows, coef, sbuf, sbits), "local", 0, None)
    if "memcpy" in ops:
        dst2 = np.empty_like(g)
        cases["memcpy"] = (lambda: np.copyto(dst2, g), "local", 0, None)
    return cases


DEFAULT_OPS = ("all_reduce", "all_reduce:1bit", "compress", "encode", "decompress", "memcpy")
OPS = DEFAULT_OPS + ("all_reduce:1bit-ar", "all_reduce:1bit-new", "all_reduce:1bit-flat",
                     "all_reduce:1bit-hier", "compress:fused", "server")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench compressed",
                                     description=__doc__.split("\n\n")[0])
    common.add_common_args(parser, default_sizes="1K:64M")
    parser.add_argument("--kernels", choices=("auto", "numba", "numpy", "torch"), default="auto",
                        help="kernel family for every 1-bit row (default: numba when installed, "
                             "else numpy; torch: torch ops on CPU)")
    parser.add_argument("--ops", type=common.comma_list(OPS, all_word=False),
                        default=list(DEFAULT_OPS),
                        help=f"comma list of rows to measure (default {','.join(DEFAULT_OPS)}; "
                             f"also {','.join(o for o in OPS if o not in DEFAULT_OPS)})")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    parser.add_argument("--rounds", type=int, default=None, metavar="R",
                        help="interleaved measurement rounds per size; each op keeps its best "
                             "round (default 3; 1 with --crossover)")
    parser.add_argument("--crossover", action="store_true",
                        help="find the size from which 1-bit beats fp32: here and on netsim at "
                             "each --rates (bench.crossover); --json/--plot get its results")
    parser.add_argument("--rates", default="100mbit,1gbit,10gbit",
                        help="with --crossover: netsim link rates ('' for none; default "
                             "100mbit,1gbit,10gbit)")
    parser.add_argument("--ranks", type=int, default=2,
                        help="with --crossover outside mpiexec: ranks of the local run (default 2)")
    return parser


def main(argv: list[str]) -> int:
    """Run the benchmark (collective over MPI.COMM_WORLD); 0 when every checked value was right."""
    args = _parser().parse_args(argv)
    if args.crossover:
        from . import crossover
        default = common.parse_sizes("1K:64M")
        args.crossover_sizes = (crossover.DEFAULT_SIZES if args.sizes == default
                                else ",".join(str(s) for s in args.sizes))
        args.rounds = 1 if args.rounds is None else args.rounds
        try:
            return crossover.run(args, MPI.COMM_WORLD, main)
        except ValueError as exc:
            print(f"bench compressed --crossover: {exc}", file=sys.stderr)
            return 2
    if args.rounds is None:
        args.rounds = 3
    import compressed
    return _run(args, compressed)


def _run(args, compressed) -> int:
    import torch

    from compressed.families import family_for
    from compressed.wire_format import Layout, fp32_allreduce_wire_bytes

    world = MPI.COMM_WORLD
    p = world.Get_size()
    kernels = None if args.kernels == "auto" else args.kernels
    fam = family_for(kernels, torch.device("cpu"))
    impl = fam.name
    ops = args.ops
    backend = compressed.MpiBackend(comm=world, kernels=kernels)
    onebit: dict = {}  # hierarchical setting -> OnebitAllreduce (made once: collective)
    wanted = {"all_reduce:1bit-ar": None, "all_reduce:1bit-new": None,
              "all_reduce:1bit-flat": False, "all_reduce:1bit-hier": True}
    for op, hier in wanted.items():
        if op in ops and hier not in onebit:
            try:
                onebit[hier] = compressed.OnebitAllreduce(world, kernels=kernels, hierarchical=hier)
            except ValueError as exc:  # the same on every rank
                if world.Get_rank() == 0:
                    print(f"bench compressed: {op}: {exc}", file=sys.stderr)
                return 2
    rep = common.Reporter(BENCH, world, args, COLUMNS)
    most = len(backend.layout(max(args.sizes) // 4 or 1).pieces())
    rep.start(dtype="float32", extra=[
        f"kernels: {impl}; 1-bit messages: packed signs per chunk, scales in trailers "
        f"(compressed.wire_format); {most} piece(s) per phase at the largest size "
        f"({'ranks on one node' if backend.comm.local_size == p else 'ranks on several nodes'}); "
        f"default algorithm: {backend.hierarchy.describe()}",
        "x_fp32: time / fp32 all_reduce time at the same size; local rows run on every rank at once",
    ])
    summary: list[str] = []
    for size in args.sizes:
        n = max(1, size // 4)
        nbytes = n * 4
        lay = Layout(n, p)
        rng = np.random.default_rng(world.Get_rank())
        g = rng.standard_normal(n).astype(np.float32)
        cases = _cases(ops, g, lay, world, backend, onebit, fam, kernels, rng)
        best: dict[str, tuple[float, float, float]] = {}
        meter, sent = netsim.LinkMeter(world), {}  # bytes on the simulated links (netsim only)
        for _ in range(args.rounds):  # interleaved rounds: every op sees the same machine load
            for op, (fn, _, _, _) in cases.items():
                meter.start()
                secs, w, it = common.timed(fn, nbytes, world, iters=args.iters, warmup=args.warmup,
                                           budget_s=args.budget)
                sent.setdefault(op, []).append(meter.stop(w + it))
                if op not in best or secs[1] < best[op][1]:
                    best[op] = secs
        times = {op: secs[1] for op, secs in best.items()}
        base_time = times.get("all_reduce")
        for op, (_, peer, wire, check) in cases.items():
            secs = best[op]
            wrong = 0 if args.no_check or check is None else check()
            local = peer == "local"
            algbw = nbytes / secs[1] / 1e9 if secs[1] > 0 else 0.0
            busbw = algbw if local else algbw * common.busbw_factor("all_reduce", p)
            rec = common.make_record(bench=BENCH, op=op, dtype="float32", size_bytes=nbytes,
                                     info=rep.info, times_s=secs, algbw_gbps=algbw,
                                     busbw_gbps=busbw, wire_bytes=wire, wrong=wrong, peer=peer,
                                     count=n, kernels=impl, rounds=args.rounds)
            rec["x_fp32"] = secs[1] / base_time if base_time else None
            if meter.enabled and not local:
                rec["wire_bytes_measured"] = sum(sent[op]) / len(sent[op])
            rep.emit(rec)
        parts = [f"{common.format_size(nbytes)}:"]
        if "all_reduce" in times and "all_reduce:1bit" in times:
            parts.append(f"1-bit/fp32 time {times['all_reduce:1bit'] / times['all_reduce']:.3f}x "
                         f"(fp32/1-bit {times['all_reduce'] / times['all_reduce:1bit']:.1f}x)")
            parts.append(f"wire fp32/1-bit {fp32_allreduce_wire_bytes(n, p) / max(1, lay.wire_bytes()):.1f}x")
            if meter.enabled:
                counted = sum(sent["all_reduce"]) / max(1e-9, sum(sent["all_reduce:1bit"]))
                parts.append(f"counted on the links fp32/1-bit {counted:.1f}x")
        for op in ("all_reduce:1bit-ar", "all_reduce:1bit-new", "all_reduce:1bit-flat",
                   "all_reduce:1bit-hier"):
            if op in times and "all_reduce" in times:
                parts.append(f"{op[11:]}/fp32 {times[op] / times['all_reduce']:.3f}x "
                             f"(fp32/{op[11:]} {times['all_reduce'] / times[op]:.1f}x)")
        if "all_reduce:1bit-ar" in times and "all_reduce:1bit" in times:
            parts.append(f"MpiBackend/OnebitAllreduce time "
                         f"{times['all_reduce:1bit'] / times['all_reduce:1bit-ar']:.3f}x")
        if "all_reduce:1bit-hier" in times and "all_reduce:1bit-flat" in times:
            parts.append(f"hier/flat time {times['all_reduce:1bit-hier'] / times['all_reduce:1bit-flat']:.3f}x")
            if meter.enabled:
                counted = sum(sent["all_reduce:1bit-hier"]) / max(1e-9, sum(sent["all_reduce:1bit-flat"]))
                parts.append(f"counted on the links hier/flat {counted:.3f}x")
        if "compress:fused" in times and "memcpy" in times:
            parts.append(f"fused compress (OnebitAllreduce) / memcpy "
                         f"{times['memcpy'] / times['compress:fused']:.2f}")
        if "compress" in times and "memcpy" in times:
            parts.append(f"compress kernel bandwidth / memcpy {times['memcpy'] / times['compress']:.2f}")
        if "encode" in times and "memcpy" in times:
            parts.append(f"(encode alone {times['memcpy'] / times['encode']:.2f})")
        if len(parts) > 1:
            summary.append(" ".join(parts))
    for line in summary:
        rep.note(line)
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
