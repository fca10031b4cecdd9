"""elastic.run: call train(state) again on the survivors after a rank fails, and on the grown
world after replacements joined."""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, TypeVar

import torch

from . import disk, epoch, grow, newcomer, replicas, rollback
from .errors import ElasticError, HostsUpdatedInterrupt, ResetCallbackError, ShardsLostError, WorldTooSmallError
from .state import TorchState

log = logging.getLogger("elastic")
F = TypeVar("F", bound=Callable[..., Any])


def _default_group_comm() -> Any:
    """The mpicomm Communicator under torch's default process group, if it is an mpicomm one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        pg = dist.distributed_c10d._get_default_group()
        backend = pg._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001 - not our backend
        return None
    return getattr(backend, "comm", None)


def _revoke(comms: list[Any]) -> None:
    for c in comms:
        if c is None:
            continue
        try:
            c.revoke()
        except Exception as e:  # noqa: BLE001 - already revoked or freed: nothing left to stop
            log.debug("elastic: revoke of %r failed: %s", c, e)


def is_failure(state: TorchState, err: BaseException) -> bool:
    """Whether ``err`` means that a rank was lost (an mpicomm.RankFailedError in its chain, or
    one of the state's communicators revoked or knowing a failed rank: DDP and torch wrap the
    backend's error in their own); anything else is the user's error, raised at once."""
    from mpi4py import MPI

    import mpicomm
    from mpicomm import faults

    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, mpicomm.RankFailedError) or (isinstance(e, MPI.Exception) and faults.is_failure(e)):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    for comm in _comms_of(state, None):
        try:
            if comm is not None and (comm.revoked or comm.failed_ranks()):
                return True
        except Exception:  # noqa: BLE001 - a communicator MPI no longer answers for
            continue
    return False


def run(func: F | None = None, *, min_world_size: int = 1, max_world_size: int | None = None,
        wait_for_replacements: bool = False, spare: bool = False) -> Any:
    """Decorate ``train(state, ...)`` so a rank failure rolls ``state`` back to its last commit
    on the survivors and calls ``train`` again; ``min_world_size``: fewer survivors end the job;
    ``max_world_size``: after a loss (or ``state.check_host_updates()`` finding new slots) the
    job spawns replacements up to that many ranks (Open MPI, ULFM): after a recovery, at the
    first ``state.commit()`` (the recovered step done at full speed). They join at the first
    commit after all of them started, while the job trains on at its size (``train`` is then
    called again on the grown world), or, with ``wait_for_replacements``, spawned and joined at
    once, at the recovery's commit. Replacements not started when ``train`` returns leave.
    ``spare``: at ``max_world_size`` ranks, one more process starts ahead of a loss (its imports
    at a low CPU priority, ``MPICOMM_ELASTIC_SPARE_NICE``) and waits asleep; after a loss it
    joins at the first commit of the survivors, and the next spare starts."""
    if int(min_world_size) < 1:
        raise ValueError(f"elastic.run: expected min_world_size >= 1, got {min_world_size!r}")
    if max_world_size is not None and int(max_world_size) < int(min_world_size):
        raise ValueError(f"elastic.run: expected max_world_size >= min_world_size={min_world_size}, got "
                         f"{max_world_size!r}")
    if spare and max_world_size is None:
        raise ValueError("elastic.run: spare=True needs max_world_size (the spare joins after a loss, up to it)")
    if spare:
        grow.spare_nice()       # a bad MPICOMM_ELASTIC_SPARE_NICE fails here, not at the spawn
    if max_world_size is not None:
        newcomer.spawn_timeout()    # (as a bad MPICOMM_ELASTIC_SPAWN_TIMEOUT_S)
    if func is None:
        return functools.partial(run, min_world_size=min_world_size, max_world_size=max_world_size,
                                 wait_for_replacements=wait_for_replacements, spare=spare)

    @functools.wraps(func)
    def wrapper(state: TorchState, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, TorchState):
            raise TypeError(f"elastic.run: expected an elastic.TorchState as first argument, got {type(state).__name__}")
        # (a replacement takes the job's own settings when it joins: elastic.grow)
        state._min_world_size, state._max_world_size = int(min_world_size), max_world_size
        state._wait, state._spare = bool(wait_for_replacements), bool(spare)
        try:
            return _train(state, func, args, kwargs)
        finally:    # (on every survivor alike, or bounded: grow.LEAVE_S)
            grow.abandon(state, "train() ended")    # replacements starting, or the spare, leave

    return wrapper


def _train(state: TorchState, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``elastic.run``'s loop: ``train`` called again after each recovery and each growth."""
    joining = grow.joining()
    if not joining and state.world_size < state._min_world_size:
        raise WorldTooSmallError(f"elastic.run: {state.world_size} ranks, fewer than min_world_size="
                                 f"{state._min_world_size}")
    start = joining or state.generation == 0
    growing = False
    while True:
        try:
            if joining:
                joining = start = False         # (after a later failure it recovers as the others do)
                grow.join(state)                # a replacement: the state comes from live ranks
            elif start:
                start = False
                state._resume()
                state._commit(state.commits)
                state._spawn_due = state._spare and state.world_size == state._max_world_size  # the spare starts
            if growing:
                growing = False
                grow.grow(state, state._max_world_size, wait=state._wait)
            out = func(state, *args, **kwargs)
            state.wait_checkpoint()
            epoch.leave(state)                  # train returns on every survivor or on none
            return out
        except ElasticError:
            raise
        except grow.Regrouped:
            pass                                # replacements joined at a commit: train again
        except HostsUpdatedInterrupt:
            growing = True                      # at the commit check_host_updates followed
        except Exception as err:  # noqa: BLE001 - a failure shows as any error (DDP wraps it)
            if not getattr(state.comm, "fault_tolerant", False) or not is_failure(state, err):
                raise
            recover(state, err, state._min_world_size)
            grow.after_loss(state)              # a spare, or replacements starting, may join now
            most = state._max_world_size
            if most is not None and state.world_size < most:
                # waiting: the replacements join at once; else they start once the recovered
                # step committed, so their start-up does not slow that step
                growing = state._wait
                state._spawn_due = not state._wait


def _comms_of(state: TorchState, comm: Any) -> list[Any]:
    """The communicators a recovery revokes: ``comm`` and those elastic knows of (each with its family)."""
    comms = [comm, state.comm, _default_group_comm()]
    if state.sharded:
        comms.append(state.optimizer.comm)
        comms.append(getattr(state.optimizer, "_grad_comm", None))  # its gradient communicator (a dup)
    return comms


def recover(state: TorchState, err: BaseException, min_world_size: int = 1) -> dict[str, Any]:
    """Revoke, shrink to the survivors, re-create the process group, roll ``state`` back to the
    newest commit every survivor holds whole (or, when a shard and its replica were both lost, to
    the newest checkpoint of ``checkpoint_dir``), run the reset callbacks; a rank failing
    meanwhile starts it again over the fewer survivors. Re-raises ``err`` when no rank was lost,
    unless a commit's agreement heard of a failure (``CommitAborted``, raised on every rank: all
    roll back); raises ``ElasticError`` on every survivor when the job cannot go on."""
    t0, wall0 = time.monotonic(), time.time()
    state._uses_dist()                    # (before an attempt drops the group)
    old = state.comm
    old_world, old_rank = state.world_size, state.rank
    held = list(state._commits)           # what every attempt rolls back from
    comm, new, outcome, attempts = old, None, "none", 0
    while True:
        attempts += 1
        _revoke(_comms_of(state, comm))
        if attempts == 1:
            epoch.close(state)              # survivors inside a commit's agreement are let out of it
        saving, state._saving = state._saving, None
        settled = disk.settle(saving)       # revoked with the rest: it ends (or had committed)
        outcome = settled if outcome == "none" else outcome
        if new is None:
            new = comm.shrink()
            t_shrink = time.monotonic()
            if new.size == comm.size and not isinstance(err, epoch.CommitAborted):
                raise err
            # (none lost: Open MPI reported a failure to a commit's agreement that the shrink does
            # not confirm. Every rank got that, and all of them go back to the commit before.)
        state._commits[:] = held
        done, again = _attempt(state, new, old_rank, old_world, min_world_size, err)
        if done is not None:
            break
        comm, (new, err) = new, again       # a rank failed during the recovery: again, over fewer
    survivors, gen, resumed = done
    epoch.open(state)                       # the next commit agrees over the survivors
    lost = sorted(set(range(old_world)) - set(survivors))
    info = {"lost": lost, "survivors": survivors, "old_world": old_world,
            "generation": gen if resumed is None else None, "commits": state.commits,
            "attempts": attempts, "save_in_flight": outcome, "from_disk": resumed,
            "started_at": wall0, "shrink_s": t_shrink - t0, "recover_s": time.monotonic() - t0}
    state.recoveries.append(info)
    if new.rank == 0:
        where = f"the checkpoint {resumed['path']}" if resumed else f"commit {gen}"
        log.warning("elastic: recovered in %.2f s, rolled back to %s", info["recover_s"], where)
    return info


def _target(state: TorchState, new: Any, old_rank: int, old_world: int, survivors: list[int]) -> int | None:
    """The generation to roll back to (collective over ``new``), or None to restart from disk;
    raises ``ShardsLostError`` where neither can be."""
    sharded = "ZeroOptimizer" if state.sharded else "FSDP2" if state._fsdp else None
    lost = replicas.lost_shards(old_world, survivors, state.replica_stride) if sharded else []
    if not lost:
        gen = rollback.choose(new, rollback.offers(state, old_rank, old_world, survivors))
        if gen is not None:
            return gen
    why = ("no checkpoint_dir to fall back to" if state.checkpoint_dir is None
           else None if disk.newest_exists(state, new)
           else f"{state.checkpoint_dir} holds no committed checkpoint yet")
    if why is None:
        return None
    what = (f"the {sharded} shards of old ranks {lost} are lost (each rank and its buddy, "
            f"{state.replica_stride} on, both failed; survivors: old ranks {survivors})" if lost
            else f"no commit is held whole by every survivor (old ranks {survivors})")
    raise ShardsLostError(f"elastic: {what}; {why}", lost)


def _attempt(state: TorchState, new: Any, old_rank: int, old_world: int, min_world_size: int,
             err: BaseException) -> tuple[Any, Any]:
    """One try at carrying on over ``new``: ((old ranks of the survivors, the commit rolled back
    to, what was loaded from disk or None), None), or (None, (the survivors' shrunk communicator,
    the error seen here)) when a rank failed meanwhile (every survivor agrees on that)."""
    from mpicomm import distributed as mdist

    failed: str | None = None            # a reset callback that raised
    error: BaseException | None = None   # anything else raised here (a failure, most likely)
    survivors: list[int] = []
    gen, resumed = 0, None
    try:
        ranks = torch.zeros(new.size, dtype=torch.int64)
        new.all_gather_into_tensor(ranks, torch.tensor([old_rank], dtype=torch.int64))
        survivors = [int(r) for r in ranks]
        lost = sorted(set(range(old_world)) - set(survivors))
        if new.rank == 0 and not lost:
            log.warning("elastic: %s: %s; no rank failed: rolling back on all %d", type(err).__name__, err, new.size)
        elif new.rank == 0:
            log.warning("elastic: ranks %s of %d failed (%s: %s); going on with %d", lost, old_world,
                        type(err).__name__, err, new.size)
        if new.size < min_world_size:
            raise WorldTooSmallError(
                f"elastic.run: old ranks {lost} failed; {new.size} survivors, fewer than min_world_size="
                f"{min_world_size}") from err
        target = _target(state, new, old_rank, old_world, survivors)
        if state._uses_dist():          # (also where an attempt cut short left no group)
            mdist.reinit_process_group(new)
        if target is None:
            state._restart_from_disk(new)    # an FSDP2 model: loaded by RebuildFSDP, below
        else:
            gen = target
            state._rollback(gen, new, survivors, old_world)
        failed = state._run_callbacks()
        if target is None:
            resumed = state.resumed
        # after the callbacks: an FSDP2 model is the one RebuildFSDP made on the survivors
        if failed is None and state.checkpoint_dir is not None and state.commits % state.checkpoint_every == 0 \
                and state.commits > 0 and not disk.saved(state, new, state.commits):
            state._saving = disk.save(state, state.commits)   # the save that the failure cut short
    except ElasticError:
        raise                            # decided alike on every survivor
    except Exception as e:  # noqa: BLE001 - a failure during the recovery, or an error named below
        error = e
    if failed is not None or error is not None:
        _revoke([new])                   # no survivor stays inside a call of this attempt
    if new.agree(failed is None and error is None):
        return (survivors, gen, resumed), None
    probe = new.shrink()                 # fewer ranks: one failed during the attempt; go again
    if probe.size < new.size:
        return None, (probe, error or err)
    if failed is not None:
        raise ResetCallbackError(f"elastic: a reset callback raised after the recovery ({failed}); the job ends")
    if error is None:
        raise ElasticError("elastic: the recovery failed on another rank (a reset callback or an error there); "
                           "the job ends")
    raise ElasticError(f"elastic: the recovery failed ({type(error).__name__}: {error}); the job ends") from error
