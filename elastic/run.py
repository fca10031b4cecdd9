"""elastic.run: call train(state) again on the survivors after a rank fails."""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, TypeVar

import torch

from .errors import ElasticError, ResetCallbackError, WorldTooSmallError
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


def run(func: F | None = None, *, min_world_size: int = 1) -> Any:
    """Decorate ``train(state, ...)`` so a rank failure rolls ``state`` back to its last commit
    on the survivors and calls ``train`` again; ``min_world_size``: fewer survivors end the job."""
    if int(min_world_size) < 1:
        raise ValueError(f"elastic.run: expected min_world_size >= 1, got {min_world_size!r}")
    if func is None:
        return functools.partial(run, min_world_size=min_world_size)

    @functools.wraps(func)
    def wrapper(state: TorchState, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, TorchState):
            raise TypeError(f"elastic.run: expected an elastic.TorchState as first argument, got {type(state).__name__}")
        if state.world_size < min_world_size:
            raise WorldTooSmallError(f"elastic.run: {state.world_size} ranks, fewer than min_world_size="
                                     f"{min_world_size}")
        if state.generation == 0:
            state._resume()
            state._commit(state.commits)
        while True:
            try:
                out = func(state, *args, **kwargs)
                state.wait_checkpoint()
                return out
            except ElasticError:
                raise
            except Exception as err:  # noqa: BLE001 - a failure shows as any error (DDP wraps it)
                if not getattr(state.comm, "fault_tolerant", False):
                    raise
                recover(state, err, min_world_size)

    return wrapper


def recover(state: TorchState, err: BaseException, min_world_size: int = 1) -> dict[str, Any]:
    """Revoke, shrink to the survivors, re-create the process group, roll ``state`` back to the
    newest commit every survivor holds, run the reset callbacks. Re-raises ``err`` when no rank
    was lost; raises ``ElasticError`` on every survivor when the job cannot go on."""
    import mpicomm
    from mpicomm import distributed as mdist

    t0, wall0 = time.monotonic(), time.time()
    old = state.comm
    old_world, old_rank = state.world_size, state.rank
    comms = [old, _default_group_comm()]
    if state.sharded:
        comms.append(state.optimizer.comm)
        comms.append(getattr(state.optimizer, "_grad_comm", None))  # its gradient communicator (a dup)
    _revoke(comms)
    new = old.shrink()
    t_shrink = time.monotonic()
    if new.size == old_world:
        raise err
    ranks = torch.zeros(new.size, dtype=torch.int64)
    new.all_gather_into_tensor(ranks, torch.tensor([old_rank], dtype=torch.int64))
    survivors = [int(r) for r in ranks]
    lost = sorted(set(range(old_world)) - set(survivors))
    if new.rank == 0:
        log.warning("elastic: ranks %s of %d failed (%s: %s); going on with %d", lost, old_world,
                    type(err).__name__, err, new.size)
    if new.size < min_world_size:
        raise WorldTooSmallError(
            f"elastic.run: old ranks {lost} failed; {new.size} survivors, fewer than min_world_size="
            f"{min_world_size}") from err
    gen = torch.tensor([state.generation], dtype=torch.int64)
    new.all_reduce(gen, op=mpicomm.ReduceOp.MIN)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        mdist.reinit_process_group(new)
    state._rollback(int(gen), new, survivors, old_world)
    failed: str | None = None
    for fn in state._callbacks:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported on every survivor below
            failed = f"{getattr(fn, '__qualname__', repr(fn))}: {type(e).__name__}: {e}"
            break
    if not new.agree(failed is None):
        raise ResetCallbackError(f"elastic: a reset callback raised after the recovery "
                                 f"({failed or 'on another rank'}); the job ends")
    info = {"lost": lost, "survivors": survivors, "old_world": old_world, "generation": int(gen),
            "started_at": wall0, "shrink_s": t_shrink - t0, "recover_s": time.monotonic() - t0}
    state.recoveries.append(info)
    if new.rank == 0:
        log.warning("elastic: recovered in %.2f s, rolled back to commit %d", info["recover_s"], int(gen))
    return info
