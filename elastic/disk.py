"""TorchState on disk: a ckpt checkpoint every K commits, and the resume from the newest one."""
from __future__ import annotations

import os
import random
import re
import shutil
from typing import Any

import torch

LATEST = "latest"     # ckpt's pointer to the newest committed checkpoint of a run directory
_COUNT = "elastic_commits"
#: How long a recovery waits for the checkpoint save in flight when a rank failed to end (its
#: collective calls fail once its communicator is revoked; rank 0 may be publishing it).
SETTLE_S = 60.0


class _Generator:
    """A torch.Generator as a ckpt state item."""

    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.gen.get_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.gen.set_state(sd["state"])


class _Random:
    """A random.Random as a ckpt state item."""

    def __init__(self, rnd: random.Random) -> None:
        self.rnd = rnd

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rnd.getstate()
        return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                "gauss": gauss}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.rnd.setstate((int(sd["version"]), tuple(int(v) for v in sd["internal"].tolist()), sd["gauss"]))


def _item(value: Any) -> Any:
    if isinstance(value, torch.Generator):
        return _Generator(value)
    if isinstance(value, random.Random):
        return _Random(value)
    return value


def _items(state: Any) -> dict[str, Any]:
    return {f"attr.{name}": _item(getattr(state, name)) for name in state._names}


_WORKDIR = re.compile(r"\.step[0-9]+\.tmp-[0-9a-f]+")   # ckpt's working directory of a save into step<N>


def path_for(directory: str, count: int) -> str:
    """Where the checkpoint taken after commit number ``count`` goes."""
    return os.path.join(directory, f"step{count}")


def save(state: Any, count: int) -> Any:
    """Start an async ckpt save of ``state`` (model, optimizer, attributes) after commit ``count``;
    returns its ckpt.SaveHandle."""
    import ckpt

    if state.model is None:
        raise ValueError("elastic.TorchState: checkpoint_dir needs a model (ckpt.save saves a model)")
    return ckpt.save(path_for(state.checkpoint_dir, count), model=state.model, optimizer=state.optimizer,
                     comm=_comm(state), step=count, extra={_COUNT: count}, state=_items(state),
                     overwrite=True, async_save=True)


def sweep(directory: str) -> list[str]:
    """Remove the working directories ``.step<N>.tmp-*`` that saves cut short left in
    ``directory``; returns their names. Published ``step<N>`` and ``latest`` are never touched.
    Call it (on one rank) only when no save into ``directory`` is in flight."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    gone = []
    for name in names:
        path = os.path.join(directory, name)
        if _WORKDIR.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(name)
    return gone


def _comm(state: Any) -> Any:
    return state.optimizer.comm if state.sharded else state.comm


def settle(handle: Any, timeout: float = SETTLE_S) -> str:
    """Wait for a save started before a rank failure to end, and say how it ended: "committed"
    (whole, published), "failed" (its working directory is never published, so never the newest)
    or "none". Its error is the failure being recovered from, so it is not raised; a save still
    running after ``timeout`` seconds raises ElasticError (a recovery must not read the directory
    while it may still move ``latest``). Then the async-save slots of the revoked communicators
    (a duplicated communicator and a snapshot buffer each) are freed."""
    from ckpt import async_save
    from mpicomm import WaitTimeoutError

    from .errors import ElasticError

    outcome = "none"
    if handle is not None:
        try:
            handle.wait(timeout)
            outcome = "committed"
        except WaitTimeoutError:
            raise ElasticError(f"elastic: the checkpoint save in flight when a rank failed did not end within "
                               f"{timeout:g} s; the job ends") from None
        except Exception:  # noqa: BLE001 - the failure being recovered from
            outcome = "failed"
    async_save.release_dead()  # the revoked communicators' save slots: their duplicate, their snapshot memory
    return outcome


def _rank0_says(comm: Any, flag: bool) -> bool:
    out = torch.tensor([int(flag)], dtype=torch.int64)
    comm.broadcast(out, src=0)
    return bool(out[0])


def newest_exists(state: Any, comm: Any) -> bool:
    """Whether ``state.checkpoint_dir`` holds a committed checkpoint (rank 0 looks; all agree)."""
    return _rank0_says(comm, int(comm.rank) == 0 and os.path.isfile(os.path.join(state.checkpoint_dir, LATEST)))


def saved(state: Any, comm: Any, count: int) -> bool:
    """Whether the checkpoint of commit ``count`` was published (rank 0 looks; all agree)."""
    return _rank0_says(comm, int(comm.rank) == 0 and os.path.isdir(path_for(state.checkpoint_dir, count)))


def load(state: Any) -> dict[str, Any]:
    """Load the newest checkpoint of ``state.checkpoint_dir`` into ``state`` at the current world
    size; returns what was loaded (path, commit count, the world size it was saved at)."""
    import ckpt

    items = _items(state)
    res = ckpt.load(state.checkpoint_dir, model=state.model, optimizer=state.optimizer, comm=_comm(state),
                    state=items)
    for name in state._names:
        key = f"attr.{name}"
        if isinstance(items[key], (_Generator, _Random)) or key not in res.state:
            continue
        state._attrs[name] = res.state[key]
    extra = res.extra if isinstance(res.extra, dict) else {}
    count = int(extra.get(_COUNT, res.step or 0))
    return {"path": res.path, "commits": count, "saved_world_size": res.world_size}
