"""Growing the job back: the ranks training spawn replacements (``MPI_Comm_spawn`` of this very
program, ``Intercomm_merge``) at a commit, and the newcomers receive the replicated state from
rank 0 and their ZeroOptimizer / FSDP2 shards from the live ranks (the re-partition a recovery
uses), with no disk. A join that fails (a newcomer or the spawn itself) leaves the ranks training
at their size, with a note; a replacement that cannot join leaves."""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from mpicomm import faults

from . import epoch, fsdp, newcomer, repartition, rollback, wire
from .commit import Commit
from .errors import HostsUpdatedInterrupt

log = logging.getLogger("elastic")
#: An executable printing ``host:slots`` lines (Horovod's host discovery contract).
HOSTS_ENV = "MPICOMM_ELASTIC_HOSTS"
#: How often (seconds) ``check_host_updates`` runs the discovery at most.
INTERVAL_ENV = "MPICOMM_ELASTIC_HOSTS_INTERVAL"
#: The tag of a replacement's "ready" message to each rank of the job over the merged communicator.
READY_TAG = 7461
#: How often (seconds) a replacement waiting to join tests its agreement with the job (it sleeps between).
IDLE_S = 0.02
#: The nice value of a spare's start-up imports (``elastic.run(spare=True)``; 0: none).
SPARE_NICE_ENV = "MPICOMM_ELASTIC_SPARE_NICE"
#: How long (seconds) the ranks leaving ``elastic.run`` wait for the replacements to hear that they leave too.
LEAVE_S = 60.0
#: What a rank left inside a spawn that did not return says as it leaves the job (bench elastic --chaos reads it).
LEFT_A_SPAWN = "this rank leaves the job"
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
    most = state._max_world_size
    if most is None or not os.environ.get(HOSTS_ENV) or state.world_size >= most or state.growing:
        return
    slots, _ = _slots(state, force=False)
    if min(slots, most) > state.world_size:
        raise HostsUpdatedInterrupt(f"elastic: {slots} slots listed for {state.world_size} ranks; growing "
                                    f"to {min(slots, most)}")


def spare_nice() -> int:
    """The nice value of a spare's start-up imports (``MPICOMM_ELASTIC_SPARE_NICE``, default 10)."""
    raw = os.environ.get(SPARE_NICE_ENV, "10")
    try:
        nice = int(raw)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise ValueError(f"elastic: expected {SPARE_NICE_ENV} an int in [0, 19], got {raw!r}")
    return nice


def _spawn(comm: Any, command: str, args: list[str], k: int, info: Any) -> Any:
    """``comm.Spawn``, or this rank's end (SIGKILL, with a message) where it does not return in
    ``newcomer.spawn_timeout()`` seconds: Open MPI's spawn is not fault tolerant (a rank of ``comm``
    that fails during it can leave the others inside it for good). A rank killed by a signal is a
    failure like any other to the ranks that got out of the spawn (its non-roots may fail out of
    it): they recover without it. Where every rank was left inside, the job ends."""
    limit = newcomer.spawn_timeout()

    def stuck() -> None:
        print(f"elastic: MPI_Comm_spawn of {k} replacements did not return in {limit:g} s "
              f"({newcomer.SPAWN_TIMEOUT_ENV}); a rank that failed during it leaves the others inside it (the "
              f"spawn is not fault tolerant): {LEFT_A_SPAWN}; the ranks out of the spawn recover "
              "without it, and where none is, the job ends (restart it from its checkpoint_dir)",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        # a signal, not MPI_Abort: under ULFM the abort did not end the ranks out of the spawn, which
        # then went on (chaos seed 15041); nor an error status: Open MPI's launcher ends a job where
        # two ranks exit with one (docs/elastic.md, Limits)
        os.kill(os.getpid(), signal.SIGKILL)
    timer = threading.Timer(limit, stuck)
    timer.daemon = True
    timer.start()
    try:
        return comm.Spawn(command, args=args, maxprocs=k, info=info, root=0)
    finally:
        timer.cancel()


def _command(nice: int = 0) -> tuple[str, list[str]]:
    """What a replacement runs: this program, through ``elastic/newcomer.py`` (MPI first; with
    ``nice``, its imports start in a thread at that nice value), or as it was started where its
    command line cannot be split (then the spawn waits for its imports)."""
    orig = list(getattr(sys, "orig_argv", []) or [sys.executable, *sys.argv])
    split = newcomer.split_argv(orig[1:])
    if split is None:
        return sys.executable, orig[1:]
    opts, program = split
    if os.path.abspath(program[0]) == os.path.abspath(newcomer.__file__):
        program = newcomer.strip_options(program[1:])   # a replacement itself: its program
    return sys.executable, [*opts, os.path.abspath(newcomer.__file__), *newcomer.options(nice), *program]


class Regrouped(Exception):  # noqa: N818 - a signal to elastic.run, not an error
    """Raised by ``state.commit()`` after replacements joined (or failed to) at that commit:
    ``elastic.run`` calls ``train`` again on the world as it is now."""


@dataclasses.dataclass
class Pending:
    """A growth under way: the replacements are starting; they join at a commit once all are ready."""
    merged: Any             # the MPI intra-communicator of the live ranks (low) and the replacements
    old_world: int
    k: int
    t0: float
    spawn_s: float
    at: int                 # state.commits when they were spawned
    spare: bool = False     # spawned at full size, ahead of a loss (elastic.run(spare=True))
    ready: set[int] = dataclasses.field(default_factory=set)   # replacements that said so to this rank
    commits: int = 0        # commits seen while waiting (with room for them)
    needed: float | None = None   # when a loss made room for a spare


def at_commit(state: Any) -> None:
    """At a commit (collective): replacements with room to join do once all are ready (a spare
    at full size waits); else those due start."""
    p = state._growing
    if p is not None:
        if state.world_size + p.k <= (state._max_world_size or 0):
            if p.needed is None:
                p.needed = time.monotonic()
            poll(state)
    elif state._spawn_due:
        state._spawn_due = False
        grow(state, state._max_world_size)


def after_loss(state: Any) -> None:
    """After a recovery: a spare (or replacements starting) now has room to join from here."""
    p = state._growing
    if p is not None and p.needed is None and state.world_size + p.k <= (state._max_world_size or 0):
        p.needed = time.monotonic()


def due(state: Any) -> bool:
    """Whether the job is growing back: replacements start at the next commit, or are starting
    with room to join (not a spare waiting at full size)."""
    most = state._max_world_size or 0
    p = state._growing
    return state._spawn_due and state.world_size < most or p is not None and state.world_size + p.k <= most


def grow(state: Any, max_world_size: int | None, wait: bool = False) -> dict[str, Any] | None:
    """Spawn replacements up to ``max_world_size`` ranks, or at that size a spare
    (``state._spare``); collective over ``state.comm``. They join at the first commit with room
    for them after all of them are ready (``poll``), while the job trains on, or, with ``wait``,
    here at the newest commit (raising ``Regrouped``; replacements already started are waited
    for). Returns what happened, or None when nothing was tried."""
    from mpi4py import MPI

    if max_world_size is None or not getattr(state.comm, "fault_tolerant", False):
        return None
    p = state._growing
    if p is not None:
        if wait and state.world_size + p.k <= max_world_size:
            poll(state, block=True)
        return None
    slots, hosts = _slots(state, force=True)
    room = max_world_size if slots < 0 else min(slots, max_world_size)
    k = room - state.world_size
    spare = k <= 0 and state._spare and state.world_size == max_world_size and slots != state.world_size
    k = 1 if spare else k
    if k <= 0:
        return None
    t0 = time.monotonic()
    old = state.comm
    command, args = _command(spare_nice() if spare else 0)
    info = MPI.Info.Create()
    info.Set("wdir", os.getcwd())
    if hosts:
        info.Set("add-host", ",".join(hosts))
    try:
        inter = _spawn(old.mpi_comm, command, args, k, info)
    except MPI.Exception as e:
        return _record(state, {"spawned": 0, "world": state.world_size, "note": f"the spawn of {k} ranks failed ({e})",
                               "grow_s": time.monotonic() - t0, "spare": spare, "at_commit": state.commits})
    finally:
        info.Free()
    spawn_s = time.monotonic() - t0
    merged = inter.Merge(high=False)   # (an mpicomm.Communicator is collective: made at the join)
    inter.Free()
    state._growing = Pending(merged, int(old.size), k, t0, spawn_s, state.commits, spare=spare)
    if wait and not spare:
        poll(state, block=True)
    return {"pending": k, "spawn_s": spawn_s, "spare": spare}


def _record(state: Any, done: dict[str, Any]) -> dict[str, Any]:
    state.growths.append(done)
    if state.rank == 0:
        if done["note"] is None:
            log.warning("elastic: grew to %d ranks in %.2f s", state.world_size, done["grow_s"])
        else:
            log.warning("elastic: %s; going on with %d ranks", done["note"], state.world_size)
    return done


def poll(state: Any, block: bool = False) -> None:
    """At a commit, with replacements starting and room for them (collective): when every one
    is ready (with ``block``, once it is), they join now and ``Regrouped`` is raised; one that
    died gives the growth up. Each rank hears from each replacement itself, so the ready ones
    are known whichever live ranks failed since the spawn."""
    from mpi4py import MPI

    p = state._growing
    keep = True
    try:
        _hear(p, block)
    except (MPI.Exception, RuntimeError) as e:     # a replacement failed while starting
        log.warning("elastic: a replacement failed before it joined (%s)", e)
        keep = False
    ready = len(p.ready) == p.k
    p.commits += 0 if block else 1
    ready, keep = epoch.poll(state, ready, keep)
    if not keep:
        abandon(state, "a replacement failed before it joined")
        raise Regrouped()
    if not ready:
        return
    state._growing = None
    state.wait_checkpoint()
    now = time.monotonic()
    ready_s = now - p.t0
    start = p.needed if p.spare and p.needed is not None else p.t0

    def done(note: str | None) -> None:
        _record(state, {"spawned": p.k if note is None else 0, "world": state.world_size, "note": note,
                        "grow_s": time.monotonic() - start, "spawn_s": p.spawn_s, "ready_s": ready_s,
                        "join_s": time.monotonic() - now, "spare": p.spare, "commits_waited": p.commits,
                        "at_commit": p.at})
    merged = None
    try:    # the replacements wait in this agreement; then the ranks that failed since the spawn go
        if faults.iagree(p.merged, 1, "the grown world") & 1:
            merged = _shrunk(p.merged)
    except Exception as e:  # noqa: BLE001 - decided alike on every live rank: the join failed
        done(f"the replacements could not join ({type(e).__name__}: {e})")
        raise Regrouped() from None
    if merged is None:
        done("the replacements could not join")
        raise Regrouped()
    try:
        note = _join(state, merged, state.comm, p.k)
    except Exception as e:  # the live ranks could not go back to the commit they hold: a rank of
        done(f"the replacements could not join ({type(e).__name__}: {e})")   # theirs failed, and the
        raise                                                                  # recovery goes on from it
    done(note)
    raise Regrouped()


def _hear(p: Pending, block: bool) -> None:
    """Receive the replacements' ready messages to this rank; with ``block``, until all came,
    asleep between looks (a blocking receive would spin, taking the CPU they start on). Raises
    where a replacement failed."""
    while True:
        failed = [r for r in faults.failed_ranks(p.merged) if r >= p.old_world]
        if failed:      # (a live rank that failed is the recovery's business)
            raise RuntimeError(f"ranks {failed} of the grown world failed")
        for r in range(p.old_world, p.old_world + p.k):
            if r not in p.ready and p.merged.Iprobe(source=r, tag=READY_TAG):
                p.merged.Recv(bytearray(1), source=r, tag=READY_TAG)
                p.ready.add(r)
        if not block or len(p.ready) == p.k:
            return
        time.sleep(IDLE_S)


def _shrunk(merged: Any) -> Any:
    """The merged communicator without the ranks that failed since the spawn (collective over
    it: the live ranks and the replacements); frees the old one."""
    new = merged.Shrink()
    merged.Free()
    return new


def abandon(state: Any, why: str) -> None:
    """Give up the growth under way or the spare, if any (collective over the live ranks): the
    replacements are told so in the agreement they wait in, and leave."""
    p, state._growing = state._growing, None
    if p is None:
        return
    try:
        faults.iagree(p.merged, 0, "the grown world", timeout_s=LEAVE_S)
        p.merged.Free()
    except Exception as e:  # noqa: BLE001 - the replacements leave on their own then
        log.warning("elastic: the replacements could not be told to leave (%s)", e)
    if p.spare and p.needed is None:    # a spare never needed: no growth to report
        log.debug("elastic: the spare leaves (%s)", why)
        return
    _record(state, {"spawned": 0, "world": state.world_size, "note": f"the growth was given up ({why})",
                    "grow_s": time.monotonic() - p.t0, "spawn_s": p.spawn_s, "spare": p.spare, "at_commit": p.at})


def join(state: Any) -> None:
    """A replacement's side of ``grow``: say so to each rank of the job, wait (asleep) until it
    takes this process in at a commit or lets it go, then take the state from it (collective
    over the grown world)."""
    global _joined
    from mpi4py import MPI

    _joined = True
    parent = MPI.Comm.Get_parent()
    early = newcomer.merged
    merged = early if early is not None else parent.Merge(high=True)
    for r in range(parent.Get_remote_size()):    # the job's ranks are the merged world's first
        try:
            merged.Send(bytearray(1), dest=r, tag=READY_TAG)
        except MPI.Exception as e:  # that rank failed: the others take this process in
            log.debug("elastic: could not tell rank %d that this replacement is ready: %s", r, e)
    try:
        go = bool(faults.iagree(merged, 1, "the grown world", idle_s=IDLE_S) & 1)
        note = _join(state, _shrunk(merged), None) if go else None
    except Exception as e:  # noqa: BLE001 - the job's side failed alike
        go, note = True, f"{type(e).__name__}: {e}"
    if not go:      # the job let this process go: it ends as any MPI process does
        log.info("elastic: the job gave the growth up; this replacement leaves")
        merged.Free()
        parent.Free()
        MPI.Finalize()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
    if note is not None:    # the job goes on without it: leave quietly (an error would abort the job)
        print(f"elastic: this replacement could not join the job ({note}); it leaves", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)


def _header(state: Any, old_world: int) -> dict[str, Any]:
    """What rank 0 tells the newcomers: the newest commit's replicated parts and layout."""
    c = state._commits[-1]
    head: dict[str, Any] = {"gen": c.gen, "count": c.count, "stride": c.stride, "world": old_world,
                            "attrs": c.attrs, "model": c.model, "optimizer": c.optimizer, "hyper": c.hyper, "rng": c.rng,
                            "keys": c.keys, "other": c.other, "trained": state._trained,
                            "run": [state._min_world_size, state._max_world_size, state._wait, state._spare],
                            "dist": state._uses_dist()}
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


def _join(state: Any, merged_mpi: Any, old: Any, k: int = 0) -> str | None:
    """Both sides of a join over the merged MPI communicator (shrunk: the ranks known failed
    left it); None when it succeeded on every rank, else what failed (every rank agrees; the
    live ranks then go on over ``old``, at the commit they hold, or raise where they cannot: one
    of them failed, and the recovery goes on from that commit). A live rank checks that ``old``'s ranks and the ``k``
    replacements are all there: one that died unseen since the last agreement fails the join
    (the live ranks then meet it in their next step)."""
    import mpicomm
    from mpicomm import distributed as mdist

    error: str | None = None
    is_new = old is None
    state._uses_dist()      # (before the join drops the group: made anew over old if it fails)
    held = list(state._commits)
    merged = None
    try:
        merged = mpicomm.Communicator(merged_mpi)
        if not is_new and int(merged.size) != int(old.size) + k:
            raise RuntimeError(f"{int(old.size) + k - int(merged.size)} of the {int(old.size)} ranks training and the "
                               f"{k} replacements failed before the join")
        sizes = wire.broadcast(merged, None if is_new else int(old.size), root=0)
        old_world = int(sizes)
        survivors = list(range(old_world)) + [-1] * (int(merged.size) - old_world)
        head = wire.broadcast(merged, None if int(merged.rank) else _header(state, old_world), root=0)
        c = _newcomer_commit(state, head) if is_new else state._commits[-1]
        if is_new:      # the job's elastic.run settings (this program may say others: max_world_size=world size)
            state._min_world_size, state._max_world_size, state._wait, state._spare = head["run"]
            rollback.restore_replicated(state, c)
            if state.optimizer is not None and not state.sharded and not state._fsdp:
                state.optimizer.load_state_dict(c.optimizer)
            state._trained, state._count, state._dist = head["trained"], c.count, head["dist"]
        if state._dist:     # (a replacement: the job's, whatever group it made itself)
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
        if faults.fault_tolerant():
            # the others may wait in a call this rank left: the header's broadcast, or the split
            # that makes the Communicator (chaos 19078: a rank left inside it for good)
            try:
                if merged is not None:
                    merged.revoke()
                else:
                    merged_mpi.Revoke()
            except Exception as r:  # noqa: BLE001 - revoked already, or freed: the agreement still decides
                log.debug("elastic: revoke of the merged communicator failed: %s", r)
    ok = False
    try:
        ok = bool(faults.agree(merged_mpi, 1 if error is None else 0) & 1) if faults.fault_tolerant() \
            else error is None
    except Exception as e:  # noqa: BLE001
        error = error or f"{type(e).__name__}: {e}"
    if ok:
        epoch.open(state)
        most = state._max_world_size
        # the rest of the growth (a rank lost meanwhile), or at full size a new spare, at the next commit
        state._spawn_due = most is not None and (state.world_size < most or state._spare)
        return None
    if not is_new:            # back to the ranks that trained, at the commit they hold
        state._comm = old
        state._commits[:] = held
        rollback.restore(state, state._commits[-1].gen, old, list(range(int(old.size))), int(old.size))
        if state._dist:
            mdist.reinit_process_group(old)
        state._run_callbacks()
        epoch.open(state)
    return error or "the join failed on another rank"
