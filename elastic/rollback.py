"""Which commit a recovery rolls back to, and the rollback itself.

Every survivor offers the generations it can restore whole: each commit it holds, when the ward
whose replica it keeps is alive or that replica is whole (a copy in shared memory says which
commit it holds, or is being written with); and generation 0, the state before any update,
where nothing was trained yet. The survivors take the newest generation all of them offer
(``choose``): ULFM gives no uniform outcome to a collective, so survivors can be one commit
apart, and each holds the two newest commits unless a commit was agreed (``elastic.epoch``)."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from . import fsdp, repartition, replicas, values
from .commit import Commit

#: At most this many generations are offered by one rank (the commits held, and 0).
_OFFERS = 3


def offers(state: Any, old_rank: int, old_world: int, survivors: Sequence[int]) -> list[int]:
    """The generations this rank can restore whole after a recovery over ``survivors`` (old
    ranks), newest first."""
    out = []
    for c in reversed(state._commits):
        ward_lost = (old_world > 1 and (state.sharded or state._fsdp)
                     and replicas.ward(old_rank, old_world, c.stride) not in survivors)
        if not ward_lost or c.ward_pieces() is not None:
            out.append(c.gen)
    if _pristine(state):
        out.append(0)
    return out[:_OFFERS]


def _pristine(state: Any) -> bool:
    """Whether the state before any update can be restored here: no update ran on this rank
    since the run began, and no sharded state needs a replica for it (a ZeroOptimizer's shards
    are then taken from the model's weights, unless they were loaded from a checkpoint; FSDP2's
    cannot be). A first commit held here is that state; without one, the live state is."""
    if state._fsdp or state._trained:
        return False
    return not (state.sharded and state.resumed is not None)


def choose(new_comm: Any, mine: Sequence[int]) -> int | None:
    """The newest generation every rank of ``new_comm`` offers, or None (collective)."""
    row = torch.full((_OFFERS,), -1, dtype=torch.int64)
    row[:len(mine)] = torch.tensor(list(mine)[:_OFFERS], dtype=torch.int64)
    every = torch.empty(_OFFERS * int(new_comm.size), dtype=torch.int64)
    new_comm.all_gather_into_tensor(every, row)
    sets = [set(r) - {-1} for r in every.view(-1, _OFFERS).tolist()]
    common = set.intersection(*sets)
    return max(common) if common else None


def commit_of(state: Any, gen: int) -> Commit | None:
    """The commit ``gen`` held here (None for generation 0 where no first commit is held)."""
    for c in state._commits:
        if c.gen == gen or (gen == 0 and c.gen == 1):
            return c
    if gen == 0:
        return None
    raise RuntimeError(f"elastic: commit {gen} is not held here (held: {[c.gen for c in state._commits]})")


@torch.no_grad()
def restore(state: Any, gen: int, new_comm: Any, survivors: Sequence[int], old_world: int) -> None:
    """Restore generation ``gen`` over ``new_comm`` (rank ``i`` was old rank ``survivors[i]``),
    then commit it there (an FSDP2 model: once ``RebuildFSDP`` has rebuilt it)."""
    c = commit_of(state, gen)
    if c is not None:
        restore_replicated(state, c)
    if state._fsdp:    # loaded into the model rebuilt on the survivors by elastic.RebuildFSDP
        fsdp.rollback(state, c.fsdp, c.count, new_comm, survivors, c.stride)
    elif state.sharded:
        if gen == 0:
            repartition.shards_from_params(state, new_comm)
        else:
            repartition.rebuild_shards(state, c, new_comm, survivors, old_world)
            state.optimizer.gather_params()          # the model's weights from the masters
    elif state.optimizer is not None and c is not None:
        state.optimizer.load_state_dict(values.tree_copy(c.optimizer))
    state._comm = new_comm
    state._commits.clear()      # commits of the old world cannot be rebuilt from in the new one
    if not state._fsdp:         # an FSDP2 state is committed by RebuildFSDP once it is rebuilt
        state._commit(c.count if c is not None else state.commits)


def restore_replicated(state: Any, c: Commit) -> None:
    """Set the attributes, the model's replicated entries, a ZeroOptimizer's hyperparameters and
    the global generators back to ``c``."""
    for name, saved in c.attrs.items():
        state._attrs[name] = values.restore(state._attrs.get(name), saved)
    if state.model is not None and not state._fsdp:
        state.model.load_state_dict(values.tree_copy(c.model), strict=not state.sharded)
    if state.sharded and c.hyper is not None:
        # a scheduler restored above does not set the learning rate back: the rate it set after
        # the commit, on some survivors only where a failure cut the step short, would stay
        for group, hp in zip(state.optimizer.param_groups, c.hyper):
            group.update(values.tree_copy(hp))
    if c.rng is not None:
        values.set_global_rng(c.rng)
