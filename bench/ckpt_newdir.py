"""The new-directory rows of ``bench ckpt`` (``--new-dir-reps R``): the FSDP2 model of the FSDP2
rows saved as a new user would, into a NEW directory every repetition (nothing removed between
them, so no save reuses the page cache another one freed), by ckpt and by torch DCP in turn, each
charged the same durability: ckpt's own fsync (``sync=True``), ckpt ``sync=False`` followed by
``os.sync()``, DCP followed by ``os.sync()``; then each loads what it saved. The order of the
peers alternates from one repetition to the next; each row is the minimum over the repetitions.
ckpt's time is also split into its phases (planning, the working directory, writing the data
file, the checksum reduction, the commit; for a load: the manifest, planning, reading, the
checksum check), measured here by timing ``ckpt.api``'s own steps from outside."""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Callable, Iterator

#: ckpt.api's steps, in the order a save (then a load) runs them
SAVE_PHASES = ("_plan_save", "_plan_writes", "create_workdir", "write_items", "commit_save")
LOAD_PHASES = ("read_manifest_text", "_plan_load", "read_items", "verify_data")
PHASE_NAMES = {"_plan_save": "plan", "_plan_writes": "plan items", "create_workdir": "workdir",
               "write_items": "write data", "commit_save": "commit", "read_manifest_text": "manifest",
               "_plan_load": "plan", "read_items": "read data", "verify_data": "verify",
               "rest": "collectives and the rest"}


@contextlib.contextmanager
def phase_timer(names: tuple[str, ...]) -> Iterator[dict[str, float]]:
    """Seconds spent in each of ``ckpt.api``'s functions ``names`` while inside (summed over
    calls; the functions are put back after)."""
    from ckpt import api

    spent = {n: 0.0 for n in names}
    real = {n: getattr(api, n) for n in names}

    def timed(name: str, fn: Callable) -> Callable:
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0
        return run

    for n in names:
        setattr(api, n, timed(n, real[n]))
    try:
        yield spent
    finally:
        for n in names:
            setattr(api, n, real[n])


def _os_sync(mpi_comm) -> None:
    """Every rank done writing, then one ``os.sync()`` (the machine's dirty pages, all of them)."""
    mpi_comm.Barrier()
    if mpi_comm.rank == 0:
        os.sync()
    mpi_comm.Barrier()


def run(world, ranks: int, layers: int, hidden: int, base: str, reps: int,
        emit: Callable[..., dict]) -> None:
    """Measure and emit the new-directory rows on the first ``ranks`` ranks of ``world``
    (collective over ``world``); a load that does not give back the saved state counts in its
    row's ``wrong``."""
    import datetime

    import torch.distributed as dist
    from mpi4py import MPI

    import ckpt
    import mpicomm
    from bench.ckpt_fsdp2 import _clear, _digest, _timed, build, load_dcp, save_dcp

    dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=600))
    group = dist.new_group(list(range(ranks))) if ranks < world.size else dist.group.WORLD
    member = world.rank < ranks
    comm = mpicomm.as_communicator(world).split(0 if member else None)
    results = None
    root = os.path.join(base, "newdir")
    if member:
        model, opt = build(group, layers, hidden, comm.rank)
        want = _digest(model, opt)
        nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
        mc = comm.mpi_comm
        keys = ("ckpt save", "ckpt save nosync", "ckpt os.sync", "ckpt load", "dcp save", "dcp os.sync",
                "dcp load")
        t: dict[str, list[float]] = {k: [] for k in keys}
        phases: dict[str, list[dict[str, float]]] = {"save": [], "load": []}
        wrong = [0, 0]

        def max_phases(spent: dict[str, float]) -> dict[str, float]:
            return {k: mc.allreduce(v, op=MPI.MAX) for k, v in spent.items()}

        def ckpt_part(rep: int) -> None:
            ours = os.path.join(root, f"ckpt-{rep}")
            with phase_timer(SAVE_PHASES) as spent:
                t["ckpt save"].append(_timed(mc, lambda: ckpt.save(ours, model=model, optimizer=opt, comm=comm)))
            phases["save"].append(max_phases(spent))
            t["ckpt save nosync"].append(_timed(mc, lambda: ckpt.save(ours + "-nosync", model=model, optimizer=opt,
                                                                      comm=comm, sync=False)))
            t["ckpt os.sync"].append(_timed(mc, lambda: _os_sync(mc)))
            _clear(model, opt)
            with phase_timer(LOAD_PHASES) as spent:
                t["ckpt load"].append(_timed(mc, lambda: ckpt.load(ours, model=model, optimizer=opt, comm=comm)))
            phases["load"].append(max_phases(spent))
            wrong[0] += mc.allreduce(int(_digest(model, opt) != want), op=MPI.SUM)

        def dcp_part(rep: int) -> None:
            theirs = os.path.join(root, f"dcp-{rep}")

            t["dcp save"].append(_timed(mc, lambda: save_dcp(model, opt, theirs, group)))
            t["dcp os.sync"].append(_timed(mc, lambda: _os_sync(mc)))
            _clear(model, opt)

            t["dcp load"].append(_timed(mc, lambda: load_dcp(model, opt, theirs, group)))
            wrong[1] += mc.allreduce(int(_digest(model, opt) != want), op=MPI.SUM)

        for rep in range(reps):  # alternate which goes first
            for part in ((ckpt_part, dcp_part) if rep % 2 == 0 else (dcp_part, ckpt_part)):
                part(rep)
        best = {k: min(v) for k, v in t.items()}
        fastest = min(range(reps), key=lambda i: t["ckpt save"][i])
        quickest = min(range(reps), key=lambda i: t["ckpt load"][i])
        save_ph = dict(phases["save"][fastest], rest=t["ckpt save"][fastest] - sum(phases["save"][fastest].values()))
        load_ph = dict(phases["load"][quickest], rest=t["ckpt load"][quickest] - sum(phases["load"][quickest].values()))
        results = (nbytes, best, save_ph, load_ph, wrong)
        if comm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        del model, opt
        comm.free()
    dist.destroy_process_group()
    nbytes, best, save_ph, load_ph, wrong = world.bcast(results, root=0)
    how = f"min of {reps}, a new directory each"
    emit("new dir: ckpt.save (fsync)", ranks, nbytes, best["ckpt save"], how + "; " + _split(save_ph))
    emit("new dir: ckpt.save nosync + os.sync", ranks, nbytes, best["ckpt save nosync"] + best["ckpt os.sync"],
         how + f"; save {best['ckpt save nosync']:.3f} s + os.sync() {best['ckpt os.sync']:.3f} s")
    emit("new dir: DCP save + os.sync", ranks, nbytes, best["dcp save"] + best["dcp os.sync"],
         how + f"; save {best['dcp save']:.3f} s + os.sync() {best['dcp os.sync']:.3f} s")
    emit("new dir: ckpt.load", ranks, nbytes, best["ckpt load"],
         how + "; " + _split(load_ph) + (", state checked" if not wrong[0] else ", WRONG STATE"), wrong=wrong[0])
    emit("new dir: DCP load", ranks, nbytes, best["dcp load"],
         how + (", state checked" if not wrong[1] else ", WRONG STATE"), wrong=wrong[1])
    ck = best["ckpt save"] + best["ckpt load"]
    dc = best["dcp save"] + best["dcp os.sync"] + best["dcp load"]
    emit("new dir: ckpt save + load", ranks, nbytes, ck, "ckpt's own fsync")
    emit("new dir: DCP save + load", ranks, nbytes, dc, "DCP + os.sync()")
    emit("new dir: time DCP / ckpt", ranks, None, None, f"{dc / ck:.2f}x (save + load, both durable)")


def _split(spent: dict[str, float]) -> str:
    """The phases of the fastest repetition, slowest rank each."""
    return "phases " + ", ".join(f"{PHASE_NAMES[k]} {v:.3f}" for k, v in spent.items())
