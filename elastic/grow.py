"""Growing the job back: the ranks training spawn replacements (``MPI_Comm_spawn`` of this very
program, ``Intercomm_merge``) at a commit, and the newcomers receive the replicated state from
rank 0 and their ZeroOptimizer / FSDP2 shards from the live ranks (the re-partition a recovery
uses), with no disk. A join that fails (a newcomer or the spawn itself) leaves the ranks training
at their size, with a note; a replacement that cannot join leaves."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Any

import torch

from . import epoch, fsdp, repartition, rollback, wire
from .commit import Commit
from .errors import HostsUpdatedInterrupt

log = logging.getLogger("elastic")
#: An executable printing ``host:slots`` lines (Horovod's host discovery contract).
HOSTS_ENV = "MPICOMM_ELASTIC_HOSTS"
#: How often (seconds) ``check_host_updates`` runs the discovery at most.
INTERVAL_ENV = "MPICOMM_ELASTIC_HOSTS_INTERVAL"
_joined = False
_last_check = [0.0, 0]     # when the discovery last ran, the slots it found


def joining() -> bool:
    """Whether this process was spawned by a growing job and has not joined it yet."""
    if _joined:
        return False
    from mpi4py import MPI

    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def discover(program: str, timeout: float = 30.0) -> dict[str, int]:
    """Run the host-discovery ``program``: its ``host:slots`` lines as {host: slots}."""
    out = subprocess.run([program], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"elastic: {HOSTS_ENV}={program} exited with {out.returncode}: {out.stderr.strip()[-500:]}")
    hosts: dict[str, int] = {}
    for line in out.stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        host, sep, slots = line.rpartition(":")
        if not sep or not host or not slots.isdigit():
            raise ValueError(f"elastic: {HOSTS_ENV}={program} printed {line!r}; expected 'host:slots' lines")
        hosts[host] = hosts.get(host, 0) + int(slots)
    return hosts


def _slots(state: Any, force: bool) -> tuple[int, list[str]]:
    """Rank 0's count of the slots the discovery lists (-1: no discovery, the launcher's
    allocation decides) and the hosts, shared with every rank (collective)."""
    program = os.environ.get(HOSTS_ENV)
    hosts: list[str] = []
    slots = -1
    if program and state.rank == 0:
        interval = float(os.environ.get(INTERVAL_ENV, "1"))
        if force or time.monotonic() - _last_check[0] >= interval:
            try:
                found = discover(program)
            except Exception as e:  # noqa: BLE001 - a failing discovery adds no host
                log.warning("elastic: host discovery failed (%s); no host added", e)
                found = {}
            _last_check[:] = [time.monotonic(), sum(found.values())]
            hosts = sorted(found)
        slots = _last_check[1]
    if program:
        slots, hosts = wire.broadcast(state.comm, (slots, hosts))
    return slots, hosts


def check_host_updates(state: Any) -> None:
    """``state.check_host_updates()``: raise HostsUpdatedInterrupt on every rank when the discovery
    lists more slots than ranks train and ``elastic.run(max_world_size=...)`` allows more."""
    most = getattr(state, "_max_world_size", None)
    if most is None or not os.environ.get(HOSTS_ENV) or state.world_size >= most:
        return
    slots, _ = _slots(state, force=False)
    if min(slots, most) > state.world_size:
        raise HostsUpdatedInterrupt(f"elastic: {slots} slots listed for {state.world_size} ranks; growing "
                                    f"to {min(slots, most)}")


def _argv() -> tuple[str, list[str]]:
    """The command that started this process (interpreter options and ``-m mpi4py`` included)."""
    orig = list(getattr(sys, "orig_argv", []) or [sys.executable, *sys.argv])
    return sys.executable, orig[1:]


def grow(state: Any, max_world_size: int | None) -> dict[str, Any] | None:
    """Spawn replacements up to ``max_world_size`` ranks and let them join at this commit
    (collective over ``state.comm``); returns what happened, or None when nothing was tried."""
    from mpi4py import MPI

    if max_world_size is None or not getattr(state.comm, "fault_tolerant", False):
        return None
    slots, hosts = _slots(state, force=True)
    room = max_world_size if slots < 0 else min(slots, max_world_size)
    k = room - state.world_size
    if k <= 0:
        return None
    t0 = time.monotonic()
    old = state.comm
    command, args = _argv()
    info = MPI.Info.Create()
    info.Set("wdir", os.getcwd())
    if hosts:
        info.Set("add-host", ",".join(hosts))
    note = None
    try:
        inter = old.mpi_comm.Spawn(command, args=args, maxprocs=k, info=info, root=0)
    except MPI.Exception as e:
        note = f"the spawn of {k} ranks failed ({e})"
    finally:
        info.Free()
    if note is None:
        merged = inter.Merge(high=False)
        note = _join(state, merged, old, t0)
    done = {"spawned": k if note is None else 0, "world": state.world_size, "note": note,
            "grow_s": time.monotonic() - t0}
    state.growths.append(done)
    if state.rank == 0:
        if note is None:
            log.warning("elastic: grew to %d ranks in %.2f s", state.world_size, done["grow_s"])
        else:
            log.warning("elastic: %s; going on with %d ranks", note, state.world_size)
    return done


def join(state: Any) -> None:
    """A replacement's side of ``grow``: merge with the job that spawned this process and take
    the state from it (collective over the grown world)."""
    global _joined
    from mpi4py import MPI

    _joined = True
    merged = MPI.Comm.Get_parent().Merge(high=True)
    note = _join(state, merged, None, time.monotonic())
    if note is not None:    # the job goes on without it: leave quietly (an error would abort the job)
        print(f"elastic: this replacement could not join the job ({note}); it leaves", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)


def _header(state: Any, old_world: int) -> dict[str, Any]:
    """What rank 0 tells the newcomers: the newest commit's replicated parts and layout."""
    import torch.distributed as dist

    c = state._commits[-1]
    head: dict[str, Any] = {"gen": c.gen, "count": c.count, "stride": c.stride, "world": old_world,
                            "attrs": c.attrs, "model": c.model, "optimizer": c.optimizer, "hyper": c.hyper, "rng": c.rng,
                            "keys": c.keys, "other": c.other, "trained": state._trained,
                            "dist": bool(dist.is_available() and dist.is_initialized())}
    if c.fsdp is not None:
        head["fsdp"] = {"entries": [[list(e.key), list(e.shape), [fsdp.shard_dim(p) for p in e.placements],
                                     str(e.dtype).removeprefix("torch.")] for e in c.fsdp["entries"]],
                        "plain": c.fsdp["plain"]}
    return head


def _newcomer_commit(state: Any, head: dict[str, Any]) -> Commit:
    c = Commit(head["gen"], head["count"], stride=head["stride"], world=head["world"], model=head["model"],
               optimizer=head["optimizer"], hyper=head["hyper"], attrs=head["attrs"], rng=head["rng"],
               keys=head["keys"], other=head["other"])
    if state.sharded:    # dtype and device templates of the pieces (the newcomer holds none)
        for g, names in zip(state.optimizer.groups, c.keys):
            c.own.extend(torch.empty(0, dtype=torch.float32, device=g.master.device) for _ in range(1 + len(names)))
    if "fsdp" in head:
        entries = [fsdp.Entry(tuple(k), tuple(s), tuple(fsdp.shard(d) for d in p), getattr(torch, t))
                   for k, s, p, t in head["fsdp"]["entries"]]
        c.fsdp = {"entries": entries, "world": head["world"], "own": None, "ward": None,
                  "plain": head["fsdp"]["plain"]}
    return c


def _join(state: Any, merged_mpi: Any, old: Any, t0: float) -> str | None:
    """Both sides of a join over the merged communicator; None when it succeeded on every rank,
    else what failed (every rank agrees; the live ranks then go on over ``old``)."""
    import mpicomm
    import torch.distributed as dist
    from mpicomm import distributed as mdist

    error: str | None = None
    newcomer = old is None
    merged = None
    held = list(state._commits)
    try:
        merged = mpicomm.Communicator(merged_mpi)
        sizes = wire.broadcast(merged, None if newcomer else int(old.size), root=0)
        old_world = int(sizes)
        survivors = list(range(old_world)) + [-1] * (int(merged.size) - old_world)
        head = wire.broadcast(merged, None if int(merged.rank) else _header(state, old_world), root=0)
        c = _newcomer_commit(state, head) if newcomer else state._commits[-1]
        if newcomer:
            rollback.restore_replicated(state, c)
            if state.optimizer is not None and not state.sharded and not state._fsdp:
                state.optimizer.load_state_dict(c.optimizer)
            state._trained, state._count = head["trained"], c.count
        if head["dist"]:
            mdist.reinit_process_group(merged)
        if state._fsdp:
            fsdp.rollback(state, c.fsdp, c.count, merged, survivors, c.stride)
        elif state.sharded:
            repartition.rebuild_shards(state, c, merged, survivors, old_world)
            state.optimizer.gather_params()
        state._comm = merged
        state._commits.clear()
        if not state._fsdp:
            state._commit(c.count)
        error = state._run_callbacks()
    except Exception as e:  # noqa: BLE001 - decided on every rank below
        error = f"{type(e).__name__}: {e}"
        if merged is not None and merged.fault_tolerant:
            try:            # the others may wait in a call this rank left (the header's broadcast)
                merged.revoke()
            except Exception as r:  # noqa: BLE001 - revoked already, or freed: the agreement still decides
                log.debug("elastic: revoke of the merged communicator failed: %s", r)
    ok = False
    try:
        if merged is not None:
            ok = merged.agree(error is None) if merged.fault_tolerant else error is None
    except Exception as e:  # noqa: BLE001
        error = error or f"{type(e).__name__}: {e}"
    if ok:
        epoch.open(state)
        return None
    if not newcomer:            # back to the ranks that trained, at the commit they hold
        state._comm = old
        state._commits[:] = held
        rollback.restore(state, state._commits[-1].gen, old, list(range(int(old.size))), int(old.size))
        if dist.is_available() and dist.is_initialized():
            mdist.reinit_process_group(old)
        state._run_callbacks()
        epoch.open(state)
    return error or "the join failed on another rank"
