"""Replicating a ZeroOptimizer shard by its gradient: what a rank sends its buddy at the first
update after a commit (the averaged gradient shard and the update's hyperparameters), and the
buddy's replay of that update on its replica at the next commit.

The rule (``gradient_commit``): a commit advances the ward's replica by replaying the ward's
update iff exactly one update of the shards happened since the previous commit, over the same
communicator, and its gradient reached the buddy; any other commit (the first, one after a
recovery or a resume, one after a skipped step or after several steps) sends the full shard.

``before_update`` (a ZeroOptimizer update pre-hook) and ``commit`` are the MPI side of it."""
from __future__ import annotations

import time
import weakref
from typing import Any, Sequence

import torch

from . import commit as commits
from . import domains, epoch, replicas
from .commit import Commit

#: Tags of the gradient exchange: the hyperparameter vector, then one per group.
TAG = 29429


def gradient_commit(has_previous: bool, same_comm: bool, updates: int, received: bool) -> bool:
    """Whether a commit replays the ward's update (else it sends the full shard): a previous
    commit over the same communicator, exactly one update since it, its gradient received."""
    return has_previous and same_comm and updates == 1 and received


def _leaves(value: Any) -> list[Any]:
    """The numeric leaves of a hyperparameter value, in order (None, strings: none)."""
    if isinstance(value, (bool, int, float)):
        return [value]
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"expected scalar tensor hyperparameters, got shape {tuple(value.shape)}")
        return [value]
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _leaves(v)]
    return []


def encode(hyperparams: Sequence[dict[str, Any]], has_grad: Sequence[bool]) -> torch.Tensor:
    """A float64 vector of the groups' numeric hyperparameters (keys sorted) and which groups have
    a gradient: [length, has_grad..., values...] (float64 holds fp32/fp64 values and ints < 2**53
    exactly)."""
    vals: list[float] = [float(bool(h)) for h in has_grad]
    for hp in hyperparams:
        for k in sorted(hp):
            vals.extend(float(x) for x in _leaves(hp[k]))
    return torch.tensor([float(len(vals) + 1), *vals], dtype=torch.float64)


def _fill(template: Any, it: Any) -> Any:
    if isinstance(template, bool):
        return bool(next(it))
    if isinstance(template, int):
        return int(next(it))
    if isinstance(template, float):
        return float(next(it))
    if isinstance(template, torch.Tensor):
        return torch.tensor(next(it), dtype=template.dtype, device=template.device).reshape(template.shape)
    if isinstance(template, (tuple, list)):
        return type(template)(_fill(v, it) for v in template)
    return template


def decode(vec: torch.Tensor, template: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[bool]]:
    """The hyperparameters and gradient flags ``encode`` packed, structured as ``template`` (the
    receiver's own, same keys and types; non-numeric values are taken from it)."""
    n = int(vec[0]) if vec.numel() else 0
    mine = encode(template, [False] * len(template))
    if n != int(mine[0]) or vec.numel() < n:
        raise ValueError(f"elastic: the ward's hyperparameters do not match this rank's ({n - 1} values "
                         f"against {int(mine[0]) - 1}): every rank must build its ZeroOptimizer alike")
    values = vec[1:n].tolist()
    flags = [v != 0.0 for v in values[:len(template)]]
    it = iter(values[len(template):])
    out = [{k: _fill(hp[k], it) for k in sorted(hp)} for hp in template]
    return out, flags


def ward_state(pieces: Sequence[torch.Tensor], keys: Sequence[Sequence[str]],
               other: Sequence[dict[str, Any]]) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Split a replica's flat list (per group: master, then the elementwise state by ``keys``)
    into per-group masters and states (``other``: per group, the non-elementwise state, cloned)."""
    if len(pieces) != sum(1 + len(names) for names in keys):
        raise ValueError(f"elastic: a replica of {len(pieces)} pieces does not match its state names {keys}")
    masters, states, i = [], [], 0
    for names, rest in zip(keys, other):
        masters.append(pieces[i])
        st = {k: pieces[i + 1 + j] for j, k in enumerate(names)}
        st.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in rest.items()})
        states.append(st)
        i += 1 + len(names)
    return masters, states


def join(masters: Sequence[torch.Tensor], states: Sequence[dict[str, Any]],
         keys: Sequence[Sequence[str]]) -> list[torch.Tensor]:
    """The flat list ``ward_state`` split, from states after an update laid out by ``keys``."""
    out: list[torch.Tensor] = []
    for m, st, names in zip(masters, states, keys):
        missing = [k for k in names if k not in st]
        if missing:
            raise ValueError(f"elastic: the replayed update left no {missing} state (the shard has it)")
        out.append(m)
        out.extend(st[k] for k in names)
    return out


_TAG = 29029       # the full shards of a commit (as elastic.sharded's)


def ensure_hook(state: Any) -> None:
    """Register ``before_update`` on ``state``'s ZeroOptimizer (once per optimizer)."""
    opt = state.optimizer
    if state._hooked is opt:
        return
    me = weakref.ref(state)

    def hook(o: Any) -> None:
        s = me()
        if s is not None:
            before_update(s, o)
    opt.register_update_pre_hook(hook)
    state._hooked = opt


@torch.no_grad()
def before_update(state: Any, opt: Any) -> None:
    """Before the first shard update after a commit: copy the shard (what a rollback to the
    commit needs once it changes) and exchange the averaged gradient shards and the update's
    hyperparameters with the buddies (the transfers travel while the copy runs)."""
    if opt is not state.optimizer or not state._commits or state._commits[-1].comm is None:
        return
    c = state._commits[-1]
    c.updates += 1
    if c.updates != 1 or not c.own_live:
        return
    t0 = time.perf_counter()
    comm, world = opt.comm, int(opt.comm.size)
    works: list[Any] = []
    if world > 1 and comm is c.comm:
        hp = opt.update_hyperparams()
        grads = [g.master.grad for g in opt.groups]
        vec = encode(hp, [g is not None for g in grads])
        inbox = torch.empty_like(vec)
        c.grad = commits.buffers_like([g.master for g in opt.groups], c.grad)
        me = int(comm.rank)
        buddy, ward = replicas.buddy(me, world, c.stride), replicas.ward(me, world, c.stride)
        works.append(comm.irecv(inbox, ward, tag=TAG))
        works.append(comm.isend(vec, buddy, tag=TAG))
        for i, (theirs, mine, g) in enumerate(zip(c.grad, grads, opt.groups)):
            works.append(comm.irecv(theirs, ward, tag=TAG + 1 + i))
            mine = torch.zeros_like(g.master) if mine is None else mine.detach()
            works.append(comm.isend(mine, buddy, tag=TAG + 1 + i))
    c.own_copy = commits.buffers_like(c.own, c.own_copy)
    commits.copy_polling(c.own_copy, c.own, works)
    c.own, c.own_live = c.own_copy, False
    for w in works:
        w.wait()
    if works:
        c.grad_hp = decode(inbox, hp)     # before the update: a mismatch fails the step
    state.replicate_seconds += time.perf_counter() - t0


@torch.no_grad()
def commit(state: Any, gen: int, count: int) -> Commit:
    """Commit ``gen`` with a ZeroOptimizer replicated by gradient: the buddy replays the ward's
    one update since the previous commit on its replica, or (``gradient_commit``'s rule) the full
    shards are sent. Under ULFM the commit is agreed over the optimizer's communicator first, so
    it happens on every survivor or on none. Returns the commit (the only one held)."""
    from zero.inner import replay_update

    from . import sharded

    ensure_hook(state)
    opt = state.optimizer
    comm, world = opt.comm, int(opt.comm.size)
    prev = state._commits[-1] if state._commits else None
    c = Commit(gen, count, comm=comm, world=world)
    c.stride = domains.stride(state, comm)
    live, c.keys, c.other = sharded.live_pieces(opt)
    live = [t.detach() for t in live]
    by_grad = prev is not None and gradient_commit(
        prev.comm is not None, prev.comm is comm and prev.stride == c.stride, prev.updates,
        prev.grad_hp is not None)
    works, staging = [], []
    if not by_grad and world > 1:
        # fresh buffers: the previous commit's replica stays whole until this one is agreed
        staging = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in live]
        me = int(comm.rank)
        for i, (mine, theirs) in enumerate(zip(live, staging)):
            works.append(comm.irecv(theirs, replicas.ward(me, world, c.stride), tag=_TAG + i))
            works.append(comm.isend(mine, replicas.buddy(me, world, c.stride), tag=_TAG + i))
    state._copy_replicated(c)
    error: BaseException | None = None
    try:
        for w in works:
            w.wait()
    except Exception as e:  # noqa: BLE001 - a failure: settled by the agreement below
        if not getattr(comm, "fault_tolerant", False):
            raise
        error = e
        comm.revoke()           # no rank stays inside a transfer of this commit
    if not epoch.agree(state, comm, error is None, gen) or error is not None:
        raise error if error is not None else RuntimeError(f"elastic: commit {gen} failed")
    c.kind = "gradient" if by_grad else "full"
    if by_grad:
        assert prev is not None
        hp, flags = prev.grad_hp
        masters, states = ward_state(prev.ward, prev.keys, prev.other)
        states = replay_update(opt.optimizer, masters, states, [g if f else None for g, f in zip(prev.grad, flags)],
                               hp)
        c.ward = join(masters, states, c.keys)
    else:
        c.ward = staging
    c.own, c.own_live = live, True
    if prev is not None and prev.comm is comm:
        c.own_copy, c.grad = prev.own_copy, prev.grad      # reused: no fresh pages to fault in
    return c
