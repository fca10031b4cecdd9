"""TorchState on disk: a ckpt checkpoint every K commits, and the resume from the newest one."""
from __future__ import annotations

import os
import random
from typing import Any

import torch

LATEST = "latest"     # ckpt's pointer to the newest committed checkpoint of a run directory
_COUNT = "elastic_commits"


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


def _comm(state: Any) -> Any:
    return state.optimizer.comm if state.sharded else state.comm


def newest_exists(state: Any, comm: Any) -> bool:
    """Whether ``state.checkpoint_dir`` holds a committed checkpoint (rank 0 looks; all agree)."""
    flag = torch.zeros(1, dtype=torch.int64)
    if int(comm.rank) == 0:
        flag[0] = int(os.path.isfile(os.path.join(state.checkpoint_dir, LATEST)))
    comm.broadcast(flag, src=0)
    return bool(flag[0])


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
        object.__setattr__(state, name, res.state[key])
    extra = res.extra if isinstance(res.extra, dict) else {}
    count = int(extra.get(_COUNT, res.step or 0))
    return {"path": res.path, "commits": count, "saved_world_size": res.world_size}
