"""Checkpoint benchmark: ZeRO Adam state saved at N ranks and loaded at M ranks, next to the disk.

Run with at least max(N, M) ranks, e.g. ``mpiexec -n 3 python -m bench ckpt``. In one run it
measures, on the same directory: the disk (one file of the checkpoint's size written from Python,
with O_DIRECT where the file system takes it as ckpt's data file is, and fdatasync'ed), ``ckpt.save`` at ``--save-ranks`` (fsync'ed), how long ``ckpt.save(...,
async_save=True)`` blocks and when it commits (a second async save: the first fills its reused
snapshot memory), ``ckpt.load`` at
``--load-ranks`` with each rank's peak RSS growth, and checks the loaded state. When DeepSpeed is
importable it then runs the same model through DeepSpeed (gloo, CPU): ``save_checkpoint`` at
``--save-ranks``, ``ds_to_universal``, and a universal ``load_checkpoint`` at ``--load-ranks``,
each in worker processes started here. Without DeepSpeed the table says that it did not run (a
figure of your own can be given with ``--reference-s`` and is labelled as such). FSDP2 rows
(``--fsdp2-ranks``): the same model under ``fully_shard`` with AdamW, ckpt save + load beside torch
DCP save + fsync of its files + load, and ckpt's async save (the first, which allocates its host
memory, and one in steady state). New-directory rows (``--new-dir-reps R``): the FSDP2 model saved
into a new directory every repetition, ckpt beside DCP + ``os.sync()``, with ckpt's phases.

Where the parts live: ``bench.ckpt_deepspeed`` (the DeepSpeed workers), ``bench.ckpt_fsdp2`` (the
FSDP2 rows), ``bench.ckpt_newdir`` (the new-directory rows); here the rest, ``main`` calling one
function per part in the order of the rows.
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

    from .reporting import Reporter


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench ckpt", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6, help="Linear(hidden, hidden) layers (default 6)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096: 100.7M parameters)")
    p.add_argument("--stage", type=int, choices=(1, 2), default=1, help="ZeRO stage (default 1)")
    p.add_argument("--save-ranks", type=int, default=2, help="ranks that save (default 2)")
    p.add_argument("--load-ranks", type=int, default=3, help="ranks that load (default 3)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory in /tmp)")
    p.add_argument("--no-sync", action="store_true", help="also time a save without fsync")
    p.add_argument("--no-async", action="store_true",
                   help="skip the asynchronous save (how long save(async_save=True) blocks, and commits)")
    p.add_argument("--reference-s", type=float, default=None, metavar="SECONDS",
                   help="without DeepSpeed here: your own DeepSpeed save+convert+load seconds to "
                        "compare with (labelled as given, not measured in this run)")
    p.add_argument("--deepspeed", choices=("auto", "yes", "no"), default="auto",
                   help="run DeepSpeed side by side: auto = when importable (default)")
    p.add_argument("--fsdp2-ranks", type=int, default=None,
                   help="ranks of the FSDP2 rows: the same model + AdamW under fully_shard, ckpt beside torch DCP "
                        "(save + fsync + load), async save first and steady (default 2, or 1 in a 1-rank run; "
                        "0 skips them)")
    p.add_argument("--fsdp2-reps", type=int, default=2, help="FSDP2 save/load repetitions, best kept (default 2)")
    p.add_argument("--new-dir-reps", type=int, default=0, metavar="R",
                   help="also the new-directory rows: the FSDP2 model saved into a new directory each of R "
                        "repetitions by ckpt (fsync; sync=False + os.sync()) and torch DCP (+ os.sync()), loaded "
                        "back, ckpt's phases timed (default 0: skip)")
    p.add_argument("--json", default=None, help="write the records as JSON to this file")
    p.add_argument("--simulate-ranks", type=int, default=None, metavar="N",
                   help="instead: simulate the planning of an N-rank save and load in this one process, beside "
                        "torch DCP's (--simulate-ranks N --help lists its options)")
    return p


def _polite_barrier(comm) -> None:
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.001)


def _sub(world, n: int):
    import mpicomm
    from mpi4py import MPI

    c = world.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)
    return None if c == MPI.COMM_NULL else mpicomm.Communicator(c)


def _model(layers: int, hidden: int, seed: int | None):
    """``layers`` x Linear(hidden, hidden); ``seed=None``: uninitialised, to load into."""
    from bench import models

    return models.mlp(hidden, layers, seed=seed)


def _timed_collective(comm, fn):
    from mpi4py import MPI

    _polite_barrier(comm)
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    return out, comm.allreduce(dt, op=MPI.MAX)


def disk_bandwidth(path: str, nbytes: int, block: int = 64 << 20) -> tuple[float, str]:
    """Seconds to write ``nbytes`` to a new file at ``path`` and fdatasync it (file removed
    after), and how it was written: with O_DIRECT from an aligned buffer, as ckpt writes its data
    file (``ckpt.direct_io``: the alignment the file system takes), or, where the file system
    refuses O_DIRECT, through the page cache (ckpt then writes with MPI-IO, through it too)."""
    import numpy as np

    from ckpt import direct_io

    t0 = time.perf_counter()
    opened = direct_io.open_direct(path, True)
    if opened is None:
        fd, align, how = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1, "page cache: O_DIRECT refused"
    else:
        (fd, align), how = opened, "O_DIRECT, as ckpt writes"
    buf = direct_io.aligned_buffer(block, max(align, direct_io.ALIGN))
    buf[:] = np.random.default_rng(0).integers(0, 255, size=block, dtype=np.uint8)
    try:
        pos = 0
        while pos < nbytes:
            n = -(-min(block, nbytes - pos) // align) * align  # whole aligned blocks; the excess cut below
            pos += os.pwrite(fd, memoryview(buf[:n]), pos)
        os.ftruncate(fd, nbytes)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt, how


def _async_save(comm, model, opt, path: str) -> tuple[float, float]:
    """Seconds ``ckpt.save(async_save=True)`` blocks, and until its commit, for a second async
    save (the first fills the reused snapshot memory); the slowest rank's times."""
    from mpi4py import MPI

    import ckpt

    ckpt.save(path + "-async0", model=model, optimizer=opt, step=1, comm=comm, async_save=True).wait()
    _polite_barrier(comm.mpi_comm)
    t0 = time.perf_counter()
    handle = ckpt.save(path + "-async1", model=model, optimizer=opt, step=1, comm=comm, async_save=True)
    blocks = time.perf_counter() - t0
    handle.wait()
    total = time.perf_counter() - t0
    if comm.rank == 0:
        shutil.rmtree(path + "-async0", ignore_errors=True)
    return comm.mpi_comm.allreduce(blocks, op=MPI.MAX), comm.mpi_comm.allreduce(total, op=MPI.MAX)


def _one_step(args, comm):
    """The benchmark's model and ZeRO Adam after one step on random gradients."""
    import torch

    from zero import ZeroOptimizer

    model = _model(args.layers, args.hidden, seed=0)
    opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=args.stage, comm=comm,
                        lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def _columns():
    from bench.common import Column

    return (Column("op", "op", 28, align="<"), Column("ranks", "ranks", 5, "d"),
            Column("size_bytes", "bytes", 12, "d"), Column("time_s", "time(s)", 9, ".3f"),
            Column("gbps", "GB/s", 7, ".3f"), Column("wrong", "#wrong", 7, "d"),
            Column("note", "note", 1, align="<"))


# -- the program, part by part, in the order the rows appear --------------------------------------

@dataclass
class _Run:
    """What every part of one ``bench ckpt`` run shares: ranks, arguments, directory, output."""

    world: MPI.Comm
    args: argparse.Namespace
    base: str
    rep: Reporter
    nbytes: int

    @property
    def path(self) -> str:
        return os.path.join(self.base, "ck")

    def emit(self, op: str, ranks: int, size: int | None, seconds: float | None, note: str = "",
             wrong: int = 0) -> dict:
        """One row and its record (every rank, the same values)."""
        rec = dict(self.rep.base(op), ranks=ranks, size_bytes=size, time_s=seconds,
                   gbps=size / seconds / 1e9 if size and seconds else None, note=note,
                   wrong=wrong)
        self.rep.emit(rec)
        return rec


def _disk(run: _Run) -> float:
    """1. The disk itself: one file of the checkpoint's size, written by one process (O_DIRECT
    where the file system takes it, as ckpt writes) and fdatasync'ed."""
    got = None
    if run.world.rank == 0:
        got = disk_bandwidth(os.path.join(run.base, "disk-probe.bin"), run.nbytes)
    disk_s, how = run.world.bcast(got, root=0)
    run.emit("disk write+fdatasync", 1, run.nbytes, disk_s, f"one process, os.pwrite ({how}) + fdatasync")
    return disk_s


def _save(run: _Run, disk_s: float) -> tuple[float, list[float]]:
    """2. One step at --save-ranks, then ``ckpt.save`` (fsync) and the async save; the save's
    seconds and the weights' checksums to check the load against."""
    import ckpt

    args, world = run.args, run.world
    save_c = _sub(world, args.save_ranks)
    checksum_ref = save_s = async_s = None
    if save_c is not None:
        model, opt = _one_step(args, save_c)
        checksum_ref = [float(p.detach().double().sum()) for p in model.parameters()]
        m, save_s = _timed_collective(save_c.mpi_comm, lambda: ckpt.save(
            run.path, model=model, optimizer=opt, step=1, comm=save_c, sync=True))
        stored = sum(n for _, n in {(t.offset, t.nbytes) for t in m.tensors
                                    if t.file == "data.bin"})  # aliases (masters) once
        if stored != run.nbytes:  # the model and Adam state, nothing more, nothing less
            raise RuntimeError(f"bench ckpt: expected {run.nbytes} tensor bytes in data.bin, "
                               f"the manifest lists {stored}")
        async_s = _async_save(save_c, model, opt, run.path) if not args.no_async else None
        del model, opt, m
        save_c.mpi_comm.Free()
    gc.collect()
    _polite_barrier(world)
    save_s, checksum_ref, async_s = world.bcast((save_s, checksum_ref, async_s), root=0)
    run.emit("ckpt.save (fsync)", args.save_ranks, run.nbytes, save_s,
             f"{disk_s / save_s:.2f} x the disk's speed")
    if not args.no_async:
        run.emit("ckpt.save async: blocks", args.save_ranks, run.nbytes, async_s[0],
                 f"{async_s[0] / save_s:.3f} x the sync save's blocking time")
        run.emit("ckpt.save async: committed", args.save_ranks, run.nbytes, async_s[1],
                 "from the call to handle.wait() returning")
    return save_s, checksum_ref


def _load(run: _Run, checksum_ref: list[float]) -> tuple[float, list]:
    """3. ``ckpt.load`` at --load-ranks, the state checked, each rank's peak RSS growth against
    its own partition; the load's seconds and per load rank (growth, partition, ok)."""
    import torch

    import ckpt
    from bench.memory import reset_peak_rss, rss_kib
    from zero import ZeroOptimizer

    args, world = run.args, run.world
    load_c = _sub(world, args.load_ranks)
    load_s = rss = None
    if load_c is not None:
        model = _model(args.layers, args.hidden, seed=None)
        for p in model.parameters():  # a built model: its weights are resident before loading
            p.detach().zero_()
        opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=args.stage,
                            comm=load_c, lr=1.0)
        part = sum(g.master.numel() for g in opt.groups) * 4 * 3
        gc.collect()
        reset = reset_peak_rss() is None
        before = rss_kib("VmRSS")
        _, load_s = _timed_collective(load_c.mpi_comm, lambda: ckpt.load(
            run.path, model=model, optimizer=opt, comm=load_c))
        peak = rss_kib("VmHWM") if reset else -1
        growth = (peak - before) * 1024 if reset else None
        ok = [float(p.detach().double().sum()) for p in model.parameters()] == checksum_ref
        ok = ok and float(opt.param_groups[0]["lr"]) == 1e-4
        rss = load_c.mpi_comm.gather((growth, part, ok), root=0)
        del model, opt
        load_c.mpi_comm.Free()
    gc.collect()
    _polite_barrier(world)
    load_s, rss = world.bcast((load_s, rss), root=0)
    bad_state = sum(1 for _, _, ok in rss if not ok)
    run.emit("ckpt.load", args.load_ranks, run.nbytes, load_s,
             "state checked" if not bad_state else "WRONG STATE", wrong=bad_state)
    return load_s, rss


def _save_nosync(run: _Run) -> float:
    """3b. A save without fsync (page cache speed); flushed untimed before going on."""
    import ckpt

    args, world = run.args, run.world
    save_c = _sub(world, args.save_ranks)
    nosync_s = None
    if save_c is not None:
        model, opt = _one_step(args, save_c)
        _, nosync_s = _timed_collective(save_c.mpi_comm, lambda: ckpt.save(
            run.path + "-nosync", model=model, optimizer=opt, step=1, comm=save_c, sync=False))
        del model, opt
        save_c.mpi_comm.Free()
    _polite_barrier(world)
    if world.rank == 0:
        os.sync()  # so that its write-back does not slow down what follows
    nosync_s = world.bcast(nosync_s, root=0)
    gc.collect()
    return nosync_s


def _deepspeed(run: _Run, total: float) -> tuple[float | None, str]:
    """4. DeepSpeed on the same model when it runs here (else ``--reference-s``); its rows and
    the speed-up; the reference seconds (None: none) and where they come from."""
    from bench import ckpt_deepspeed

    args, world = run.args, run.world
    ds = None
    ds_wrong = 0
    if args.deepspeed == "yes" or (args.deepspeed == "auto" and ckpt_deepspeed.available()):
        ds_err = None
        if world.rank == 0:
            try:
                ds = ckpt_deepspeed.measure(args, run.base)
            except Exception as exc:  # noqa: BLE001 - reported on every rank
                ds_err = f"{type(exc).__name__}: {exc}"
        _polite_barrier(world)
        ds, ds_err = world.bcast((ds, ds_err), root=0)
        if ds_err:
            if world.rank == 0:
                print(f"# DeepSpeed run failed: {ds_err}", file=sys.stderr)
            if args.deepspeed == "yes":
                ds_wrong = 1
    reference, ref_note = None, ""
    if ds is not None:
        run.emit("DeepSpeed save_checkpoint", args.save_ranks, None, ds[0], "torch.save, no fsync")
        run.emit("DeepSpeed ds_to_universal", 1, None, ds[1], "python -m ..., default workers")
        run.emit("DeepSpeed load universal", args.load_ranks, None, ds[2], "")
        reference, ref_note = sum(ds), "measured in this run"
    elif args.reference_s is not None:
        reference, ref_note = args.reference_s, "given with --reference-s, not measured here"
    if reference is None:
        why = ("--deepspeed no" if args.deepspeed == "no" else "DeepSpeed is not installed"
               if not ckpt_deepspeed.available() else "the DeepSpeed run failed")
        run.emit("DeepSpeed save+convert+load", args.save_ranks, None, None, f"not run: {why}",
                 wrong=ds_wrong)
    else:
        run.emit("DeepSpeed save+convert+load", args.save_ranks, None, reference, ref_note,
                 wrong=ds_wrong)
        run.emit("speed-up (ckpt vs DeepSpeed)", args.save_ranks, None, None,
                 f"{reference / total:.1f}x ({ref_note})")
    return reference, ref_note


def _rss_rows(run: _Run, rss: list) -> None:
    """The load's peak RSS growth per rank, against its partition + 64 MiB."""
    for r, (growth, part, _ok) in enumerate(rss):
        over = 0
        if growth is None:
            note = "peak RSS not measurable (/proc/self/clear_refs refused)"
        else:
            limit = part + (64 << 20)
            over = int(growth > limit)
            note = (f"peak RSS growth {growth / 2**20:.0f} MiB vs partition {part / 2**20:.0f} MiB "
                    f"+ 64 MiB: {'OVER' if over else 'ok'}")
        run.emit(f"load peak RSS growth, rank {r}", run.args.load_ranks, growth, None, note,
                 wrong=over)


def _fits(world: MPI.Comm, n_params: int, nbytes: int) -> bool:
    """Collective: whether the least this run holds fits in rank 0's MemAvailable (1.5x margin):
    each rank's fp32 weights and gradients, and the ranks' Adam partitions twice (the state and
    async save's snapshot); if not, rank 0 says so and every rank gets False."""
    from bench.memory import gib, memory_fit

    note = None
    if world.rank == 0:
        fit = memory_fit(2 * nbytes / 1024, n_params * 8 / 1024, world.size)
        if not fit.fits:
            note = (f"bench ckpt: not run: {world.size} ranks of --layers/--hidden's {n_params / 1e6:.0f}M "
                    f"parameters would hold at least {gib(fit.need_kib)} (x1.5 margin) where "
                    f"{gib(fit.available_kib)} is available; pass a smaller --hidden or --layers")
            print(note, file=sys.stderr, flush=True)
    return world.bcast(note, root=0) is None


def _start(args, world: MPI.Comm) -> _Run | None:
    """Collective: the ranks checked, the directory, the header; a ``_Run`` (None: too few ranks)."""
    import torch

    from bench.common import Reporter

    if args.fsdp2_ranks is None:
        args.fsdp2_ranks = min(2, world.size)
    need = max(args.save_ranks, args.load_ranks, args.fsdp2_ranks)
    if world.size < need:
        if world.rank == 0:
            print(f"bench ckpt: expected at least {need} ranks (--save-ranks {args.save_ranks}, "
                  f"--load-ranks {args.load_ranks}, --fsdp2-ranks {args.fsdp2_ranks}), got {world.size}",
                  file=sys.stderr)
        return None
    n_params = args.layers * (args.hidden * args.hidden + args.hidden)
    nbytes = n_params * 4 * 3  # fp32 masters (= the fp32 weights) + exp_avg + exp_avg_sq
    if not _fits(world, n_params, nbytes):
        return None
    torch.set_num_threads(1)
    base = args.dir
    if world.rank == 0:
        base = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
    base = world.bcast(base, root=0)
    rep = Reporter("ckpt", world, args, _columns())
    rep.start(dtype="float32 weights, fp32 Adam (ZeRO-%d)" % args.stage,
              iterations="1 (each operation once, in this order)",
              extra=[f"model: {args.layers} x Linear({args.hidden}, {args.hidden}) = "
                     f"{n_params / 1e6:.1f}M parameters; dir: {base}"],
              meta={"params": n_params, "layers": args.layers, "hidden": args.hidden,
                    "stage": args.stage, "dir": base})
    return _Run(world, args, base, rep, nbytes)


def main(argv: list[str]) -> int:
    if any(a == "--simulate-ranks" or a.startswith("--simulate-ranks=") for a in argv):
        from bench import ckpt_simulate  # one process, no MPI job: planning for N simulated ranks

        return ckpt_simulate.main(argv)
    args = _parser().parse_args(argv)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    run = _start(args, world)
    if run is None:
        return 2
    try:
        disk_s = _disk(run)
        save_s, checksum_ref = _save(run, disk_s)
        load_s, rss = _load(run, checksum_ref)
        total = save_s + load_s
        run.emit("ckpt save + load", args.save_ranks, run.nbytes, total, "")
        if args.fsdp2_ranks:  # 3a. FSDP2: ckpt beside torch DCP on the same state, async save
            from bench import ckpt_fsdp2

            gc.collect()
            ckpt_fsdp2.run(world, args.fsdp2_ranks, args.layers, args.hidden, run.base,
                           args.fsdp2_reps, run.emit)
            gc.collect()
        if args.new_dir_reps > 0 and args.fsdp2_ranks:  # 3b. a new directory every save
            from bench import ckpt_newdir

            ckpt_newdir.run(world, args.fsdp2_ranks, args.layers, args.hidden, run.base, args.new_dir_reps,
                            run.emit)
            gc.collect()
        nosync_s = _save_nosync(run) if args.no_sync else None
        reference, ref_note = _deepspeed(run, total)
        if args.no_sync:
            run.emit("ckpt.save (no fsync)", args.save_ranks, run.nbytes, nosync_s,
                     f"with the load: {reference / (nosync_s + load_s):.1f}x faster than DeepSpeed"
                     if reference is not None else "")
        _rss_rows(run, rss)
        versus = (f" = {reference / total:.1f}x faster than DeepSpeed's {reference:.1f} s ({ref_note})"
                  if reference is not None else " (DeepSpeed not run)")
        run.rep.note(f"save throughput {run.nbytes / save_s / 1e6:.0f} MB/s = {disk_s / save_s:.2f} "
                     f"x the disk's {run.nbytes / disk_s / 1e6:.0f} MB/s; save+load {total:.2f} s"
                     f"{versus}")
    finally:
        _polite_barrier(world)
        if world.rank == 0 and args.dir is None:
            shutil.rmtree(run.base, ignore_errors=True)
    return run.rep.finish()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
