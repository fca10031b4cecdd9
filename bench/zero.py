"""ZeroOptimizer in a training step: time (with overlap), peak memory per rank, bytes per step.

    mpiexec -n 2 python -m bench zero [--parts time,memory,bytes] [--hidden 1024 --layers 8]
        [--mem-hidden 2048 --mem-layers 12] [--steps 4] [--json out.json]

All rows of a part run in the same job, one after the other, on the same MLP (``layers``
Linear(hidden, hidden) + Tanh, fp32, AdamW or Adam). time: DDP + AdamW on gloo and on gloo with
its buckets averaged through mpicomm (allreduce_ddp_hook) vs ZeroOptimizer(AdamW) stages 1 and 2 (its
gradients travel over mpicomm), in interleaved rounds (one step of each row in turn); per phase
medians, and backward alone / communication alone / both overlapped. memory: the peak resident
memory of each rank (VmHWM, reset between rows through /proc/self/clear_refs) above what the
process held before the row, for DDP + AdamW, ZeroOptimizer stages 1 and 2 and FSDP2
(fully_shard on gloo). bytes: payload bytes each rank hands to MPI per step, counted by a
wrapper around the communicator's MPI calls, for ZeRO Adam, ZeRO 1-bit Adam (after
freeze_step), each also with the int8 weight all-gather (gather_bits=8), and OnebitAdam without
ZeRO.
"""
from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
from typing import Any, Callable

import torch
from mpi4py import MPI

from . import common, models
from .memory import malloc_returns_memory, reset_peak_rss, rss_kib

PARTS = ("time", "memory", "bytes")
BENCH = "zero"

C = common.Column
TIME_COLUMNS = (C("peer", "row", 36, align="<"), C("backward_ms", "backward", 9, ".1f"),
                C("wait_ms", "wait", 7, ".1f"), C("opt_step_ms", "opt.step", 9, ".1f"),
                C("step_ms", "step", 8, ".1f"), C("x_ddp_gloo", "vs DDP gloo", 12, ".2f"),
                C("wrong", "#wrong", 7, "d"))
OVERLAP_COLUMNS = (C("peer", "row", 36, align="<"), C("bwd_alone_ms", "bwd alone", 10, ".1f"),
                   C("comm_alone_ms", "comm alone", 11, ".1f"), C("sum_ms", "sum", 7, ".1f"),
                   C("overlapped_ms", "overlapped", 11, ".1f"), C("hidden_pct", "hidden(%)", 10, ".0f"))
MEMORY_COLUMNS = (C("peer", "row", 36, align="<"), C("peak_text", "peak MiB per rank", 20),
                  C("x_model", "x model", 8, ".2f"), C("wrong", "#wrong", 7, "d"),
                  C("note", "note", 1, align="<"))
BYTES_COLUMNS = (C("peer", "row", 42, align="<"), C("mib_per_step", "MiB/step", 9, ".2f"),
                 C("x_model", "x fp32 model", 13, ".3f"), C("wrong", "#wrong", 7, "d"),
                 C("calls_text", "by call (rank 0, MiB)", 1, align="<"))


def make_model(hidden: int, layers: int, seed: int = 0) -> torch.nn.Module:
    """``layers`` x (Linear(hidden, hidden), Tanh)."""
    return models.mlp(hidden, layers, activation="tanh", seed=seed)


def batch(hidden: int, n: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, hidden, generator=g), torch.randn(n, hidden, generator=g)


# -- time -----------------------------------------------------------------------------------------

class Phases:
    """Per-step phase times (seconds) of one row."""

    def __init__(self) -> None:
        self.t: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.t.setdefault(name, []).append(seconds)

    def med(self, name: str) -> float:
        return statistics.median(self.t[name]) if name in self.t else math.nan


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class ZeroRow:
    """ZeroOptimizer(AdamW): backward alone (no_sync), sent after backward, sent from hooks."""

    def __init__(self, args, mpi: MPI.Comm, stage: int) -> None:
        from zero import ZeroOptimizer
        import mpicomm

        self.args, self.mpi = args, mpi
        self.model = make_model(args.hidden, args.layers)
        self.opt = ZeroOptimizer(torch.optim.AdamW, self.model.parameters(), stage=stage,
                                 comm=mpicomm.init(), bucket_bytes=args.bucket_mb << 20, lr=1e-4)
        self.ph = Phases()

    def step(self, s: int, rec: bool) -> None:
        x, y = batch(self.args.hidden, self.args.batch, s, self.mpi.rank)
        opt, ph = self.opt, self.ph
        for mode in ("alone", "serial", "overlap"):
            opt.zero_grad()
            self.mpi.Barrier()
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            if mode == "alone":                 # backward without any communication
                with opt.no_sync():
                    t = _timed(loss.backward)
                if rec:
                    ph.add("bwd_alone", t)
                continue
            opt.overlap = mode == "overlap"
            t_bwd = _timed(loss.backward)
            t_wait = _timed(lambda: opt.clip_grad_norm_(math.inf))   # reduce (or wait) + one small allreduce
            t_step = _timed(opt.step)
            if rec:
                ph.add(f"bwd_{mode}", t_bwd)
                ph.add(f"wait_{mode}", t_wait)
                ph.add(f"step_{mode}", t_step)

    def close(self) -> None:
        self.opt.close()


class DDPRow:
    """DDP + AdamW: backward under no_sync, an allreduce of all gradients alone, a DDP step."""

    def __init__(self, args, mpi: MPI.Comm, via_mpicomm: bool) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        import mpicomm

        self.args, self.mpi, self.via_mpicomm = args, mpi, via_mpicomm
        self.model = DDP(make_model(args.hidden, args.layers), bucket_cap_mb=args.bucket_mb)
        if via_mpicomm:
            self.model.register_comm_hook(mpicomm.init(), mpicomm.distributed.allreduce_ddp_hook)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.flat = torch.zeros(sum(p.numel() for p in self.model.parameters()))
        self.ph = Phases()

    def step(self, s: int, rec: bool) -> None:
        import torch.distributed as dist

        import mpicomm

        x, y = batch(self.args.hidden, self.args.batch, s, self.mpi.rank)
        model, opt, ph = self.model, self.opt, self.ph
        opt.zero_grad()
        self.mpi.Barrier()
        with model.no_sync():
            t = _timed(torch.nn.functional.mse_loss(model(x), y).backward)
        if rec:
            ph.add("bwd_alone", t)
        self.mpi.Barrier()
        if self.via_mpicomm:
            t = _timed(lambda: mpicomm.init().all_reduce(self.flat, op="avg"))
        else:
            t = _timed(lambda: dist.all_reduce(self.flat))
        if rec:
            ph.add("comm_alone", t)
        opt.zero_grad()
        self.mpi.Barrier()
        loss = torch.nn.functional.mse_loss(model(x), y)
        t_bwd = _timed(loss.backward)      # DDP's allreduce overlaps backward and is waited for inside it
        t_step = _timed(opt.step)
        if rec:
            ph.add("bwd_overlap", t_bwd)
            ph.add("wait_overlap", 0.0)
            ph.add("step_overlap", t_step)

    def close(self) -> None:
        pass


def part_time(args, mpi: MPI.Comm, rep: common.Reporter) -> None:
    rows = [("DDP+AdamW gloo", DDPRow(args, mpi, False)),
            ("DDP+AdamW gloo, buckets via mpicomm", DDPRow(args, mpi, True)),
            ("ZeRO-1 AdamW (mpicomm)", ZeroRow(args, mpi, 1)),
            ("ZeRO-2 AdamW (mpicomm)", ZeroRow(args, mpi, 2))]
    for s in range(args.steps + 1):        # interleaved rounds: one step of every row in turn
        for _, row in rows:
            row.step(s, rec=s > 0)
    res = {}
    for name, row in rows:
        # the slowest rank decides a step
        res[name] = {k: mpi.allreduce(row.ph.med(k), op=MPI.MAX) for k in row.ph.t}
        row.close()
    base = _total(res[rows[0][0]])
    n = sum(p.numel() for p in make_model(args.hidden, 1).parameters()) * args.layers
    rep.section(f"step time, {mpi.size} ranks, {n / 1e6:.1f}M params ({4 * n / 2**20:.0f} MiB "
                f"fp32), batch {args.batch}, buckets {args.bucket_mb} MiB, median of {args.steps} "
                f"interleaved rounds, ms (slowest rank)", TIME_COLUMNS)
    records = []
    for name, v in res.items():
        tot = _total(v)
        comm = v["comm_alone"] if "comm_alone" in v else v["wait_serial"]
        over = v["bwd_overlap"] + v["wait_overlap"]
        both = v["bwd_alone"] + comm
        rec = dict(rep.base("time"), peer=name, params=n, steps=args.steps,
                   backward_ms=1e3 * v["bwd_overlap"], wait_ms=1e3 * v["wait_overlap"],
                   opt_step_ms=1e3 * v["step_overlap"], step_ms=1e3 * tot, x_ddp_gloo=tot / base,
                   bwd_alone_ms=1e3 * v["bwd_alone"], comm_alone_ms=1e3 * comm, sum_ms=1e3 * both,
                   overlapped_ms=1e3 * over, hidden_pct=100 * (both - over) / comm if comm else 0.0,
                   phases_ms={k: 1e3 * t for k, t in v.items()}, wrong=0)
        records.append(rec)
        rep.emit(rec)
    rep.section("overlap: backward + gradient communication, ms", OVERLAP_COLUMNS)
    for rec in records:
        rep.show(rec)
    rep.note("ZeRO 'comm alone': reduce-scatter/reduce after a backward without hooks sending; "
             "'hidden': share of the communication time not added to backward")


def _total(v: dict) -> float:
    return v["bwd_overlap"] + v["wait_overlap"] + v["step_overlap"]


# -- memory ---------------------------------------------------------------------------------------

def mem_row(args, mpi: MPI.Comm, kind: str) -> float:
    """Peak MiB above the starting resident size while building and training one row."""
    from zero import ZeroOptimizer
    import mpicomm

    gc.collect()
    mpi.Barrier()
    base = rss_kib("VmRSS")
    problem = reset_peak_rss()
    if problem:
        raise RuntimeError(problem)
    model = make_model(args.mem_hidden, args.mem_layers)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, bucket_cap_mb=args.bucket_mb)
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (mpi.size,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), stage=int(kind[4]),
                            comm=mpicomm.init(), bucket_bytes=args.bucket_mb << 20, lr=1e-4)
    for s in range(2):
        x, y = batch(args.mem_hidden, args.batch, s, mpi.rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    mpi.Barrier()
    peak = (rss_kib("VmHWM") - base) / 1024
    if hasattr(opt, "close"):
        opt.close()
    del model, opt
    gc.collect()
    return peak


def part_memory(args, mpi: MPI.Comm, rep: common.Reporter) -> None:
    malloc_returns_memory()
    n = sum(p.numel() for p in make_model(args.mem_hidden, 1).parameters()) * args.mem_layers
    mib = 4 * n / 2**20
    title = (f"peak memory per rank above the process's start, {mpi.size} ranks, model "
             f"{n / 1e6:.1f}M params = {mib:.0f} MiB fp32, 2 steps")
    problem = mpi.bcast(reset_peak_rss(), root=0)
    if problem:
        rep.section(f"{title}: skipped, {problem}", MEMORY_COLUMNS)
        return
    rows = [("DDP+AdamW gloo", "ddp"), ("ZeRO-1 AdamW", "zero1"), ("ZeRO-2 AdamW", "zero2"),
            ("FSDP2 (fully_shard) + AdamW gloo", "fsdp2")]
    rep.section(title, MEMORY_COLUMNS)
    for name, kind in rows:
        rec = dict(rep.base("memory"), peer=name, params=n, model_mib=mib, wrong=0)
        try:
            peaks = mpi.allgather(mem_row(args, mpi, kind))
        except Exception as exc:  # noqa: BLE001 - a row that cannot run is reported, not fatal
            rec.update(peak_mib_per_rank=None, x_model=None,
                       note=f"did not run: {type(exc).__name__}: {exc}"[:140])
        else:
            rec.update(peak_mib_per_rank=peaks, x_model=max(peaks) / mib, note="",
                       peak_text=" / ".join(f"{p:.0f}" for p in peaks))
        rep.emit(rec)


# -- bytes ----------------------------------------------------------------------------------------

class CountingComm:
    """Forwards to an mpi4py communicator; counts the payload bytes this rank hands to MPI calls."""

    SEND_FIRST = {"Allreduce", "Iallreduce", "Reduce_scatter_block", "Ireduce_scatter_block", "Reduce",
                  "Ireduce", "Allgather", "Iallgather", "Alltoall", "Ialltoall", "Alltoallv", "Ialltoallv",
                  "Send", "Isend", "Gather", "Igather", "Allgatherv", "Iallgatherv"}

    def __init__(self, comm: MPI.Intracomm, counts: dict) -> None:
        self._comm = comm
        self._counts = counts

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._comm, name)
        if name in self.SEND_FIRST or name in ("Bcast", "Ibcast"):
            def call(*a, **kw):
                self._count(name, a)
                return attr(*a, **kw)
            return call
        return attr

    def _count(self, name: str, a: tuple) -> None:
        if name in ("Bcast", "Ibcast"):
            root = a[1] if len(a) > 1 else 0
            n = _nbytes(a[0]) if self._comm.Get_rank() == root else 0
        else:
            n = _nbytes(a[0])
            if n is None:                                  # MPI.IN_PLACE: the data is in recvbuf
                n = _nbytes(a[1]) or 0
                if name in ("Allgather", "Iallgather"):
                    n //= self._comm.Get_size()
        key = name[1].upper() + name[2:] if name[0] == "I" and name[1].islower() else name
        self._counts[key] = self._counts.get(key, 0) + (n or 0)


def _nbytes(spec: Any) -> int | None:
    if spec is None or spec is MPI.IN_PLACE:
        return None
    if isinstance(spec, (list, tuple)):
        buf, rest = spec[0], list(spec[1:])
        dtype = rest.pop() if rest and isinstance(rest[-1], MPI.Datatype) else None
        if dtype is None or not rest:
            return memoryview(buf).nbytes if not hasattr(buf, "nbytes") else int(buf.nbytes)
        counts = rest[0]
        if isinstance(counts, tuple) and len(counts) == 2 and not isinstance(counts[0], int):
            counts = counts[0]
        total = counts if isinstance(counts, int) else sum(counts)
        return int(total) * dtype.Get_size()
    return int(spec.nbytes) if hasattr(spec, "nbytes") else memoryview(spec).nbytes


def bytes_row(args, mpi: MPI.Comm, kind: str, stage: int = 1, bits: int | None = None) -> dict:
    from zero import ZeroOptimizer
    import compressed
    import mpicomm

    counts: dict = {}
    comm = mpicomm.Communicator(mpi.Dup())
    comm.mpi_comm = CountingComm(comm.mpi_comm, counts)
    model = make_model(args.hidden, args.layers)
    if kind == "zero-adam":
        opt: Any = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=stage, comm=comm,
                                 gather_bits=bits, lr=1e-4)
    elif kind == "zero-1bit":
        opt = ZeroOptimizer(compressed.OnebitAdam, model.parameters(), stage=stage, comm=comm,
                            gather_bits=bits, lr=1e-4, freeze_step=1)
    else:
        opt = compressed.OnebitAdam(model.parameters(), lr=1e-4, freeze_step=1, comm=comm)
    if hasattr(opt, "_grad_comm") and opt._grad_comm is not comm:
        opt._grad_comm.mpi_comm = CountingComm(opt._grad_comm.mpi_comm, counts)
    steps = 3
    for s in range(2 + steps):
        if s == 2:
            counts.clear()
        x, y = batch(args.hidden, args.batch, s, mpi.rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if hasattr(opt, "close"):
        opt.close()
    return {k: v / steps for k, v in counts.items()}


def part_bytes(args, mpi: MPI.Comm, rep: common.Reporter) -> None:
    n = sum(p.numel() for p in make_model(args.hidden, 1).parameters()) * args.layers
    rows = [("ZeRO-1 Adam", "zero-adam", 1, None), ("ZeRO-2 Adam", "zero-adam", 2, None),
            ("ZeRO-1 Adam, int8 gather", "zero-adam", 1, 8),
            ("ZeRO-1 1-bit Adam (frozen)", "zero-1bit", 1, None), ("ZeRO-2 1-bit Adam (frozen)", "zero-1bit", 2, None),
            ("ZeRO-1 1-bit Adam (frozen), int8 gather", "zero-1bit", 1, 8),
            ("ZeRO-2 1-bit Adam (frozen), int8 gather", "zero-1bit", 2, 8),
            ("OnebitAdam, no ZeRO (frozen)", "onebit", 1, None)]
    res = {name: bytes_row(args, mpi, kind, stage, bits) for name, kind, stage, bits in rows}
    worst = {name: mpi.allreduce(sum(v.values()), op=MPI.MAX) for name, v in res.items()}
    rep.section(f"bytes each rank hands to MPI per step (counted), {mpi.size} ranks, "
                f"{n / 1e6:.1f}M params ({4 * n / 2**20:.1f} MiB fp32), mean of 3 steps after "
                f"freeze_step", BYTES_COLUMNS)
    for name, v in res.items():
        by_call = mpi.bcast(v, root=0)
        rep.emit(dict(rep.base("bytes"), peer=name, params=n, bytes_per_step=worst[name],
                      mib_per_step=worst[name] / 2**20, x_model=worst[name] / (4 * n),
                      by_call=by_call, wrong=0,
                      calls_text=", ".join(f"{k} {b / 2**20:.2f}" for k, b in sorted(by_call.items()))))
    rep.note("payload handed to each MPI call by this rank; an allreduce's algorithm moves more on "
             "the links than its payload, a reduce-scatter about its payload times (p-1)/p")


# -- main -----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench zero", description=__doc__.split("\n")[0])
    p.add_argument("--parts", type=common.comma_list(PARTS), default=list(PARTS),
                   help="comma list of " + ",".join(PARTS) + " (default all)")
    p.add_argument("--hidden", type=int, default=1024, help="width of the MLP (time and bytes)")
    p.add_argument("--layers", type=int, default=8, help="Linear layers (time and bytes)")
    p.add_argument("--mem-hidden", type=int, default=2048, help="width for the memory part")
    p.add_argument("--mem-layers", type=int, default=12, help="layers for the memory part")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=4, help="timed steps per row (after one warm-up)")
    p.add_argument("--bucket-mb", type=int, default=25, help="bucket size for DDP and ZeroOptimizer (MiB)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default=None, metavar="FILE", help="write the records to FILE (rank 0)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    mpi = MPI.COMM_WORLD
    import mpicomm  # noqa: F401 - registers the backend, creates the world communicator

    common.init_gloo(mpi)
    rep = common.Reporter(BENCH, mpi, args, TIME_COLUMNS)
    rep.start(dtype="float32", iterations=f"time: 1 warm-up + {args.steps} interleaved rounds "
              "(median); memory: 2 steps per row; bytes: mean of 3 steps after 2",
              extra=[f"parts: {','.join(args.parts)}; {args.threads} torch thread(s) per rank"],
              meta={"args": vars(args)})
    for part in args.parts:
        {"time": part_time, "memory": part_memory, "bytes": part_bytes}[part](args, mpi, rep)
    return rep.finish()
