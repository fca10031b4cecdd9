"""Checkpoint benchmark: ZeRO Adam state saved at N ranks and loaded at M ranks, next to the disk.

Run with at least max(N, M) ranks, e.g. ``mpiexec -n 3 python -m bench ckpt``. In one run it
measures, on the same directory: the disk (one file of the checkpoint's size written from Python
and fdatasync'ed), ``ckpt.save`` at ``--save-ranks`` (fsync'ed), ``ckpt.load`` at
``--load-ranks`` with each rank's peak RSS growth, and checks the loaded state. DeepSpeed's
save + ds_to_universal + universal load is not run here; its figure is the reference measured on
this machine (``--reference-s``), and the table says so.
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time

from mpi4py import MPI

# DeepSpeed 0.19 on this machine (2 cores): save 3.4 s + ds_to_universal 14.1 s + load 4.4 s
REFERENCE_DEEPSPEED_S = (3.4, 14.1, 4.4)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench ckpt", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6, help="Linear(hidden, hidden) layers (default 6)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096: 100.7M parameters)")
    p.add_argument("--stage", type=int, choices=(1, 3), default=1, help="ZeRO stage (default 1)")
    p.add_argument("--save-ranks", type=int, default=2, help="ranks that save (default 2)")
    p.add_argument("--load-ranks", type=int, default=3, help="ranks that load (default 3)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory in /tmp)")
    p.add_argument("--no-sync", action="store_true", help="also time a save without fsync")
    p.add_argument("--reference-s", type=float, default=sum(REFERENCE_DEEPSPEED_S),
                   help="DeepSpeed save+convert+load seconds to compare with (default 21.9, measured here)")
    p.add_argument("--json", default=None, help="write the records as JSON to this file")
    return p


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _polite_barrier(comm: MPI.Comm) -> None:
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.001)


def _sub(world: MPI.Comm, n: int):
    import mpicomm

    c = world.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)
    return None if c == MPI.COMM_NULL else mpicomm.Communicator(c)


def _model(layers: int, hidden: int, seed: int | None):
    import torch

    if seed is not None:
        torch.manual_seed(seed)
        return torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    with torch.device("meta"):
        m = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    return m.to_empty(device="cpu")


def _timed_collective(comm: MPI.Comm, fn):
    _polite_barrier(comm)
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    return out, comm.allreduce(dt, op=MPI.MAX)


def disk_bandwidth(path: str, nbytes: int, block: int = 64 << 20) -> float:
    """Seconds to write ``nbytes`` to a new file at ``path`` and fdatasync it (file removed after)."""
    import numpy as np

    buf = np.random.default_rng(0).integers(0, 255, size=block, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[:min(block, left)])
        os.fdatasync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    import torch

    import ckpt
    from bench.common import Column, JsonWriter, Table, environment_info, header_lines

    world = MPI.COMM_WORLD
    rank = world.rank
    need = max(args.save_ranks, args.load_ranks)
    if world.size < need:
        if rank == 0:
            print(f"bench ckpt: expected at least {need} ranks (--save-ranks {args.save_ranks}, "
                  f"--load-ranks {args.load_ranks}), got {world.size}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    base = args.dir
    if rank == 0:
        base = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
    base = world.bcast(base, root=0)
    info = environment_info(world)
    n_params = args.layers * (args.hidden * args.hidden + args.hidden)
    nbytes = n_params * 4 * 3  # fp32 masters (= the fp32 weights) + exp_avg + exp_avg_sq
    table = Table([Column("op", "op", 28), Column("ranks", "ranks", 5, "d"),
                   Column("size_bytes", "bytes", 12, "d"), Column("time_s", "time(s)", 9, ".3f"),
                   Column("gbps", "GB/s", 7, ".3f"), Column("note", "note", 1)], enabled=rank == 0)
    meta = {"bench": "ckpt", "env": info, "params": n_params, "layers": args.layers,
            "hidden": args.hidden, "stage": args.stage, "dir": base}
    writer = JsonWriter(args.json, meta, enabled=rank == 0)
    wrong = 0
    if rank == 0:
        for line in header_lines("ckpt", info, dtype="float32 weights, fp32 Adam (ZeRO-%d)" % args.stage,
                                 iterations="1 (each operation once, in this order)",
                                 extra=[f"# model: {args.layers} x Linear({args.hidden}, {args.hidden}) = "
                                        f"{n_params / 1e6:.1f}M parameters; dir: {base}"]):
            print(line)

    def emit(op, ranks, size, seconds, note=""):
        rec = {"op": op, "ranks": ranks, "size_bytes": size, "time_s": seconds,
               "gbps": size / seconds / 1e9 if size and seconds else None, "note": note}
        table.row(rec)
        writer.add(rec)
        return rec

    try:
        # 1. the disk itself
        disk_s = None
        if rank == 0:
            disk_s = disk_bandwidth(os.path.join(base, "disk-probe.bin"), nbytes)
        disk_s = world.bcast(disk_s, root=0)
        emit("disk write+fdatasync", 1, nbytes, disk_s, "python os.write + fdatasync")

        # 2. train one step at --save-ranks and save
        path = os.path.join(base, "ck")
        save_c = _sub(world, args.save_ranks)
        checksum_ref = None
        save_s = None
        if save_c is not None:
            model = _model(args.layers, args.hidden, seed=0)
            opt = ckpt.ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=args.stage,
                                     comm=save_c, lr=1e-4)
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
            checksum_ref = [float(p.detach().double().sum()) for p in model.parameters()]
            m, save_s = _timed_collective(save_c.mpi_comm, lambda: ckpt.save(
                path, model=model, optimizer=opt, step=1, comm=save_c, sync=True))
            assert m.files["data.bin"]["nbytes"] == nbytes, (m.files["data.bin"]["nbytes"], nbytes)
            del model, opt, m
            save_c.mpi_comm.Free()
        gc.collect()
        _polite_barrier(world)
        save_s = world.bcast(save_s, root=0)
        checksum_ref = world.bcast(checksum_ref, root=0)
        emit("ckpt.save (fsync)", args.save_ranks, nbytes, save_s, f"{save_s and nbytes / save_s / (nbytes / disk_s):.2f} x disk")

        # 3. load at --load-ranks; peak RSS growth against the rank's own partition
        load_c = _sub(world, args.load_ranks)
        load_s = None
        rss = None
        if load_c is not None:
            model = _model(args.layers, args.hidden, seed=None)
            opt = ckpt.ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=args.stage,
                                     comm=load_c, lr=1.0)
            part = sum(g.master.numel() for g in opt.groups) * 4 * 3
            gc.collect()
            reset = _reset_peak_rss()
            before = _rss_kib("VmRSS")
            _, load_s = _timed_collective(load_c.mpi_comm, lambda: ckpt.load(
                path, model=model, optimizer=opt, comm=load_c))
            peak = _rss_kib("VmHWM") if reset else -1
            growth = (peak - before) * 1024 if reset else None
            ok = [float(p.detach().double().sum()) for p in model.parameters()] == checksum_ref
            ok = ok and float(opt.param_groups[0]["lr"]) == 1e-4
            rss = load_c.mpi_comm.gather((growth, part, ok), root=0)
            del model, opt
            load_c.mpi_comm.Free()
        gc.collect()
        _polite_barrier(world)
        load_s, rss = world.bcast((load_s, rss), root=0)
        wrong += sum(1 for _, _, ok in rss if not ok)
        emit("ckpt.load", args.load_ranks, nbytes, load_s, "state checked" if not wrong else "WRONG STATE")
        total = save_s + load_s
        emit("ckpt save + load", args.save_ranks, nbytes, total,
             f"{args.reference_s / total:.1f}x faster than DeepSpeed")
        emit("DeepSpeed save+convert+load", 2, nbytes, args.reference_s,
             "reference figure measured on this machine (DeepSpeed not run here)")
        for r, (growth, part, ok) in enumerate(rss):
            if growth is None:
                note = "peak RSS not measurable (/proc/self/clear_refs refused)"
            else:
                limit = part + (64 << 20)
                note = (f"peak RSS growth {growth / 2**20:.0f} MiB vs partition {part / 2**20:.0f} MiB "
                        f"+ 64 MiB: {'ok' if growth <= limit else 'OVER'}")
                if growth > limit:
                    wrong += 1
            emit(f"load memory, rank {r}", args.load_ranks, growth or 0, None, note)

        # 4. optional: a save without fsync (page cache speed)
        if args.no_sync:
            save_c = _sub(world, args.save_ranks)
            nosync_s = None
            if save_c is not None:
                model = _model(args.layers, args.hidden, seed=0)
                opt = ckpt.ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=args.stage,
                                         comm=save_c, lr=1e-4)
                for p in model.parameters():
                    p.grad = torch.randn_like(p)
                opt.step()
                _, nosync_s = _timed_collective(save_c.mpi_comm, lambda: ckpt.save(
                    path + "-nosync", model=model, optimizer=opt, step=1, comm=save_c, sync=False))
                del model, opt
                save_c.mpi_comm.Free()
            _polite_barrier(world)
            nosync_s = world.bcast(nosync_s, root=0)
            emit("ckpt.save (no fsync)", args.save_ranks, nbytes, nosync_s,
                 f"save+load {args.reference_s / (nosync_s + load_s):.1f}x faster than DeepSpeed")
        if rank == 0:
            print(f"# save throughput {nbytes / save_s / 1e6:.0f} MB/s = {disk_s / save_s:.2f} x the disk's "
                  f"{nbytes / disk_s / 1e6:.0f} MB/s (goal >= 0.5); save+load {total:.2f} s = "
                  f"{args.reference_s / total:.1f}x faster than DeepSpeed's {args.reference_s} s (goal >= 5)")
            print(f"# wrong: {wrong}")
    finally:
        _polite_barrier(world)
        if rank == 0 and args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
