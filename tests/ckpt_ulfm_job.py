"""A ckpt job under ULFM (``mpirun --with-ft ulfm``) where a rank dies; run by
tests/test_ckpt_ulfm.py. Every survivor writes ``<out>.<world rank>.json`` with what it saw;
MPI.File.Open is spied on (tests/file_spy.py) from the start, and O_DIRECT refused.

    ckpt_ulfm_job.py inflight DIR OUT   3+ ranks: world rank 1 dies inside its write of an async
                                        save while the others are writing theirs; the survivors'
                                        save must end with RankFailedError; after a shrink, the
                                        checkpoint saved before by every rank loads, and saves
                                        (sync, async) and loads on the survivors round-trip
    ckpt_ulfm_job.py recoveries DIR OUT 4 ranks, elastic with checkpoint_dir=DIR every commit:
                                        world rank 3 dies at step 2 and world rank 2 at step 4;
                                        counts the async-save slots (duplicated communicators,
                                        snapshot memory) still held at the end
"""
from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time

import mpicomm  # first: sets the ULFM launch defaults before MPI starts
import numpy as np
import torch
from mpi4py import MPI

import ckpt
import ckpt.api
import ckpt.async_save
import ckpt.direct_io
import ckpt.io
import ckpt.posix_io
import elastic
import elastic.disk

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from file_spy import spy_file_opens  # noqa: E402

OPENS = spy_file_opens()
# a file system that refuses O_DIRECT (tmpfs before Linux 6.6, some network file systems): where
# it is refused, the default path without ULFM is collective MPI-IO
ckpt.direct_io.open_direct = lambda *a, **k: None


def trace(out: str, what: str) -> None:
    """A line in ``<out>.<world rank>.trace`` (the test shows it when the job fails)."""
    with open(f"{out}.{mpicomm.init().rank}.trace", "a") as f:
        f.write(f"{time.time():.3f} {what}\n")


def die() -> None:
    """End this process as an OOM kill would (SIGKILL: Open MPI 5.0.11's launcher, under ULFM,
    ended the whole job when a second rank exited with a non-zero status, as tests/elastic_disk_job.py
    notes)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 64))


def train(net: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    """The same steps on every rank (no communication): every rank holds the same values."""
    for s in steps:
        opt.zero_grad()
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(s))
        net(x).square().mean().backward()
        opt.step()


def values(net: torch.nn.Module, opt: torch.optim.Optimizer) -> list[np.ndarray]:
    """Copies held apart from the objects (what a load must give back)."""
    out = [p.detach().numpy().copy() for p in net.parameters()]
    return out + [v.numpy().copy() for st in opt.state.values() for _, v in sorted(st.items())
                  if isinstance(v, torch.Tensor)]


def loaded(path: str, comm, seed: int, want: list[np.ndarray]) -> bool:
    """Load ``path`` on ``comm`` into a model and optimizer holding other values; equal to ``want``?"""
    net = model(seed)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    train(net, opt, range(100, 101))  # state of its own, other values
    ckpt.load(path, model=net, optimizer=opt, comm=comm)
    got = values(net, opt)
    return len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))


def inflight(directory: str, out: str) -> dict:
    world = mpicomm.init()
    victim = 1
    net = model(0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    train(net, opt, range(2))
    before = values(net, opt)
    ckpt.save(os.path.join(directory, "before"), model=net, optimizer=opt, step=2, comm=world)
    train(net, opt, range(2, 3))
    real = ckpt.posix_io.write
    if world.rank == victim:   # dies as its write starts, whichever path writes
        ckpt.posix_io.write = lambda *a, **k: die()
        ckpt.direct_io.write = lambda *a, **k: die()
        ckpt.io._round = lambda *a, **k: die()
    else:
        def slow(*a, **k):  # still writing when the victim dies
            time.sleep(1.0)
            return real(*a, **k)
        ckpt.posix_io.write = slow
    handle = ckpt.save(os.path.join(directory, "inflight"), model=net, optimizer=opt, step=3, comm=world,
                       async_save=True)
    t0 = time.monotonic()
    try:
        handle.wait(60)
        ended = "committed"
    except mpicomm.RankFailedError as exc:
        ended = f"RankFailedError {list(exc.failed_ranks)}"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        ended = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - t0
    opens_at_failure = len(OPENS)
    ckpt.posix_io.write = real
    new = world.shrink()
    released = ckpt.async_save.release_dead()   # the slot of the revoked world
    after = values(net, opt)
    ok_before = loaded(os.path.join(directory, "before"), new, 1, before)   # saved by 3 ranks, read by 2
    train(net, opt, range(3, 4))
    stepped = values(net, opt)
    ckpt.save(os.path.join(directory, "after-sync"), model=net, optimizer=opt, step=4, comm=new)
    ok_sync = loaded(os.path.join(directory, "after-sync"), new, 2, stepped)
    h = ckpt.save(os.path.join(directory, "after-async"), model=net, optimizer=opt, step=4, comm=new,
                  async_save=True)
    train(net, opt, range(4, 5))   # changes after save returned are not in it
    h.wait(60)
    ok_async = loaded(os.path.join(directory, "after-async"), new, 3, stepped)
    new.barrier()
    return {"ended": ended, "wait_s": took, "inflight_published": os.path.exists(os.path.join(directory, "inflight")),
            "released": released, "loaded_before": ok_before, "loaded_sync": ok_sync, "loaded_async": ok_async,
            "changed": not all(np.array_equal(a, b) for a, b in zip(after, stepped)),
            "opens_at_failure": opens_at_failure, "opens": list(OPENS), "survivors": new.size,
            "method": ckpt.io.io_method(new)}


def recoveries(directory: str, out: str) -> dict:
    world = mpicomm.init()
    created: list = []
    slot_cls = ckpt.async_save._Slot

    class Counted(slot_cls):  # every slot ever made, to count what each still holds at the end
        def __init__(self, comm):
            super().__init__(comm)
            created.append(self)
    ckpt.async_save._Slot = Counted
    kills = {2: 3, 4: 2}   # step -> world rank that dies there
    steps = 7
    net = model(0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    state = elastic.TorchState(model=net, optimizer=opt, comm=world, checkpoint_dir=directory, checkpoint_every=1,
                               step=0)

    @elastic.run
    def loop(state: elastic.TorchState) -> None:
        while state.step < steps:
            trace(out, f"step {state.step} on {state.world_size} ranks")
            if kills.get(state.step) == world.rank:
                die()
            train(state.model, state.optimizer, range(state.step, state.step + 1))
            state.step += 1
            state.commit()

    loop(state)
    trace(out, f"trained: {state.step} steps, recoveries {[r['lost'] for r in state.recoveries]}")
    state.wait_checkpoint()
    final = values(state.model, state.optimizer)
    ok = loaded(directory, state.comm, 5, final)     # the newest checkpoint: the last commit
    gc.collect()
    live = [s for s in created if s.dup.mpi_comm != MPI.COMM_NULL]
    return {"recoveries": [r["lost"] for r in state.recoveries], "slots_made": len(created),
            "slots_held": len(ckpt.async_save._SLOTS), "dups_alive": len(live),
            "snapshot_bytes": [int(s.pool.arena.numel()) for s in created], "loaded_last": ok,
            "opens": list(OPENS), "survivors": state.world_size, "steps": state.step}


def main() -> None:
    mode, directory, out = sys.argv[1:4]
    torch.set_num_threads(1)
    rank = mpicomm.init().rank
    info = {"inflight": inflight, "recoveries": recoveries}[mode](directory, out)
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main()
