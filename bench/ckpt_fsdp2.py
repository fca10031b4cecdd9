"""The FSDP2 rows of ``bench ckpt``: one FSDP2 model with AdamW state (``fully_shard`` per layer,
on the "mpicomm" torch.distributed backend), saved and loaded by ckpt and by torch DCP side by side
in one run, on the same directory, with the same durability (ckpt fsyncs its files; DCP does not,
so each rank fsyncs the files its DCP save wrote inside the timed region: ``os.sync()`` would also
flush other processes' writes on a shared machine); then ckpt's asynchronous save:
the first one (which allocates its reused host memory) and one in steady state, then one with
``snapshot='background'`` around a training step's forward and backward."""
from __future__ import annotations

import os
import shutil
import time
from typing import Callable


def _timed(mpi_comm, fn) -> float:
    """Seconds of ``fn`` on the slowest rank, started together."""
    from mpi4py import MPI

    mpi_comm.Barrier()
    t0 = time.perf_counter()
    fn()
    return mpi_comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def _digest(model, opt) -> list[float]:
    """Sums of this rank's shards of the weights and the AdamW state (float64)."""
    out = [float(p._local_tensor.double().sum()) for p in model.parameters()]
    for p in model.parameters():
        st = opt.state[p]
        out += [float(st[k]._local_tensor.double().sum()) for k in ("exp_avg", "exp_avg_sq")] + [float(st["step"])]
    return out


def _clear(model, opt) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p._local_tensor.zero_()
            st = opt.state[p]
            for k in ("exp_avg", "exp_avg_sq"):
                st[k]._local_tensor.zero_()
            st["step"].zero_()


def build(group, layers: int, hidden: int, rank: int):
    """``layers`` x Linear(hidden, hidden) under ``fully_shard`` (per layer, then the whole) on
    ``group``, with AdamW after one step: its state filled."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p._local_tensor.normal_(0, 0.02, generator=torch.Generator().manual_seed(rank))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, hidden)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def run(world, ranks: int, layers: int, hidden: int, base: str, reps: int,
        emit: Callable[..., dict]) -> None:
    """Measure and emit the FSDP2 rows on the first ``ranks`` ranks of ``world`` (collective over
    ``world``); a load that does not give back the saved state counts in its row's ``wrong``."""
    import datetime

    import torch
    import torch.distributed as dist

    import ckpt
    import mpicomm

    dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=600))
    group = dist.new_group(list(range(ranks))) if ranks < world.size else dist.group.WORLD
    member = world.rank < ranks
    comm = mpicomm.as_communicator(world).split(0 if member else None)
    results = None
    wrong = [0, 0]  # loads that did not give back the saved state: ckpt, DCP
    if member:
        model, opt = build(group, layers, hidden, comm.rank)
        want = _digest(model, opt)
        nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
        mc = comm.mpi_comm
        ours, theirs = os.path.join(base, "fsdp2-ckpt"), os.path.join(base, "fsdp2-dcp")
        t = {"ckpt save": [], "ckpt load": [], "dcp save": [], "dcp load": []}
        for rep in range(reps):  # alternate, so that neither gets a warmer cache or disk
            for d in (ours, theirs):
                if comm.rank == 0:
                    shutil.rmtree(d, ignore_errors=True)
            mc.Barrier()

            def dcp_save():
                save_dcp(model, opt, theirs, group)
                _fsync_written(theirs, comm.rank)  # DCP does not fsync: charge it the durability ckpt gives
            t["ckpt save"].append(_timed(mc, lambda: ckpt.save(ours, model=model, optimizer=opt, comm=comm)))
            t["dcp save"].append(_timed(mc, dcp_save))
            _clear(model, opt)
            t["ckpt load"].append(_timed(mc, lambda: ckpt.load(ours, model=model, optimizer=opt, comm=comm)))
            ok_ckpt = _digest(model, opt) == want
            _clear(model, opt)

            t["dcp load"].append(_timed(mc, lambda: load_dcp(model, opt, theirs, group)))
            ok_dcp = _digest(model, opt) == want
            wrong[0] += mc.allreduce(int(not ok_ckpt), op=_sum())
            wrong[1] += mc.allreduce(int(not ok_dcp), op=_sum())
        # asynchronous saves: the first allocates the reused host memory; then steady state
        first = _async_blocks(comm, model, opt, ours + "-a0")
        steady = [_async_blocks(comm, model, opt, ours + f"-a{i}") for i in (1, 2)]
        # snapshot='background', in a training loop: forward + backward run while it copies
        batch = torch.randn(8, hidden, generator=torch.Generator().manual_seed(comm.rank))
        background = [_background_blocks(comm, model, opt, ours + f"-b{i}", batch) for i in (1, 2)]
        results = (nbytes, {k: min(v) for k, v in t.items()}, first, min(steady, key=lambda x: x[0]), wrong,
                   min(background, key=lambda x: x[0]))
        for d in (ours, theirs, ours + "-a0", ours + "-a1", ours + "-a2", ours + "-b1", ours + "-b2"):
            if comm.rank == 0:
                shutil.rmtree(d, ignore_errors=True)
        del model, opt
        comm.free()
    dist.destroy_process_group()
    nbytes, best, first, steady, wrong, background = world.bcast(results, root=0)
    ck = best["ckpt save"] + best["ckpt load"]
    dc = best["dcp save"] + best["dcp load"]
    how = f"best of {reps}"
    emit("FSDP2 ckpt.save (fsync)", ranks, nbytes, best["ckpt save"], how)
    emit("FSDP2 DCP save + fsync", ranks, nbytes, best["dcp save"], how)
    emit("FSDP2 ckpt.load", ranks, nbytes, best["ckpt load"], how + (", state checked" if not wrong[0] else
                                                                      ", WRONG STATE"), wrong=wrong[0])
    emit("FSDP2 DCP load", ranks, nbytes, best["dcp load"], how + (", state checked" if not wrong[1] else
                                                                  ", WRONG STATE"), wrong=wrong[1])
    emit("FSDP2 ckpt save + load", ranks, nbytes, ck, "")
    emit("FSDP2 DCP save + load", ranks, nbytes, dc, "")
    emit("FSDP2 time DCP / ckpt", ranks, None, None, f"{dc / ck:.2f}x (save + load, both fsync'ed)")
    emit("FSDP2 async save, first: blocks", ranks, nbytes, first[0],
         f"allocates its host memory; committed after {first[1]:.2f} s")
    emit("FSDP2 async save: blocks", ranks, nbytes, steady[0],
         f"{steady[0] / best['ckpt save']:.3f} x the sync save; committed after {steady[1]:.2f} s")
    blocked, call, waited, fwd_bwd, alone, total = background
    emit("FSDP2 async save, background: blocks", ranks, nbytes, blocked,
         f"{blocked / best['ckpt save']:.3f} x the sync save: save() {call * 1e3:.0f} ms + step() waiting "
         f"{waited * 1e3:.0f} ms; forward+backward meanwhile {fwd_bwd * 1e3:.0f} ms (alone {alone * 1e3:.0f} ms); "
         f"committed after {total:.2f} s")


def save_dcp(model, opt, path: str, group) -> None:
    """torch DCP's save of the model and its optimizer, as a DCP user writes it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=group)


def load_dcp(model, opt, path: str, group) -> None:
    """torch DCP's load of what ``save_dcp`` wrote, back into the model and its optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _fsync_written(path: str, rank: int) -> None:
    """fsync the files this rank's DCP save wrote (``__<rank>_*``; rank 0 also ``.metadata`` and the
    directory): the durability ckpt's save gives, without flushing other processes' writes as
    ``os.sync()`` would on a shared machine."""
    mc = [n for n in os.listdir(path) if n.startswith(f"__{rank}_") or (rank == 0 and n == ".metadata")]
    for name in mc:
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if rank == 0:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _sum():
    from mpi4py import MPI

    return MPI.SUM


def _async_blocks(comm, model, opt, path: str) -> tuple[float, float]:
    """(seconds ``save(async_save=True)`` blocks, seconds until ``wait()`` returns), slowest rank."""
    from mpi4py import MPI

    import ckpt

    comm.mpi_comm.Barrier()
    t0 = time.perf_counter()
    handle = ckpt.save(path, model=model, optimizer=opt, comm=comm, async_save=True)
    blocks = time.perf_counter() - t0
    handle.wait()
    total = time.perf_counter() - t0
    return comm.mpi_comm.allreduce(blocks, op=MPI.MAX), comm.mpi_comm.allreduce(total, op=MPI.MAX)


def _background_blocks(comm, model, opt, path: str, batch) -> tuple[float, ...]:
    """A training step around ``save(async_save=True, snapshot='background')``: (seconds the
    loop is held: save() + the wait before step(); save() alone; the wait; forward + backward
    while the snapshot copies; forward + backward alone, just before; seconds until committed),
    each on the slowest rank."""
    from mpi4py import MPI

    import ckpt

    def fwd_bwd():
        model(batch).square().mean().backward()

    mc = comm.mpi_comm
    opt.zero_grad()
    mc.Barrier()
    t0 = time.perf_counter()
    fwd_bwd()
    alone = time.perf_counter() - t0
    opt.zero_grad()
    mc.Barrier()
    t0 = time.perf_counter()
    handle = ckpt.save(path, model=model, optimizer=opt, comm=comm, async_save=True, snapshot="background")
    t1 = time.perf_counter()
    fwd_bwd()
    t2 = time.perf_counter()
    handle.wait_snapshot()  # what opt.step() would wait for (its pre-hook)
    t3 = time.perf_counter()
    handle.wait()
    total = time.perf_counter() - t0
    opt.zero_grad()
    out = ((t1 - t0) + (t3 - t2), t1 - t0, t3 - t2, t2 - t1, alone, total)
    return tuple(mc.allreduce(x, op=MPI.MAX) for x in out)
