"""A ZeroOptimizer's shards in a state-mode commit: this rank's shard copied, sent to its buddy
and its ward's received (or, with the buddy on this host, the copy kept in shared memory that
the buddy maps: ``elastic.shm``), and the live shard kept in that shared memory when every
replica goes through it (then one slot holds the only commit)."""
from __future__ import annotations

import weakref
from typing import Any

import torch

from . import commit as commits
from . import domains, replicas, reshard, shm, values
from .commit import Commit

_TAG = 29029


def live_pieces(opt: Any) -> tuple[list[torch.Tensor], list[list[str]], list[dict[str, Any]]]:
    """``opt``'s live shard on this rank as a flat list (per group: the master, then the
    elementwise optimizer state by name), the names, and a copy of each group's other state."""
    pieces, keys, other = [], [], []
    for gi, g in enumerate(opt.groups):
        elementwise, rest = reshard.split_state(opt.shard_state(gi), g.master)
        names = sorted(elementwise)
        keys.append(names)
        other.append(values.save(rest)[1])
        pieces.append(g.master)
        pieces.extend(elementwise[k] for k in names)
    return pieces, keys, other


def send_shards(state: Any, c: Commit, old: Commit) -> list[Any]:
    """Start exchanging this rank's shard pieces with the buddies (sent from the live tensors,
    which a commit does not change) and copy them into ``c`` while they travel; return the
    transfers to wait for. Buffers of ``old`` are reused (no allocation). Through shared memory
    the copy is the buddy's replica and nothing is sent."""
    opt = state.optimizer
    originals, c.keys, c.other = live_pieces(opt)
    comm, world = opt.comm, int(opt.comm.size)
    before = state._shared[1]
    shared = _shared_over(state, comm, c.stride, originals) if world > 1 else None
    c.new_segments = shared is not before
    pieces = [t.detach() for t in originals]     # after the move into shared memory, if any
    own = shared.own if shared is not None else None
    if own is not None:         # the buddy maps this rank's copy: nothing to send
        c.own = own.pieces(c.gen)
        own.begin(c.gen)
    else:
        c.own = commits.buffers_like(pieces, [] if old.own_shm is not None else old.own)
    c.own_shm = own
    works = []
    if world > 1:
        me = int(comm.rank)
        if shared.ward is not None:
            c.ward, c.ward_shm = shared.ward.pieces(c.gen), shared.ward
            c.ward_live = shared.ward.live_pieces() if shared.live else []
        else:
            c.ward = commits.buffers_like(pieces, [] if old.ward_shm is not None else old.ward)
            for i, theirs in enumerate(c.ward):
                works.append(comm.irecv(theirs, replicas.ward(me, world, c.stride), tag=_TAG + i))
        if own is None:
            for i, mine in enumerate(pieces):
                works.append(comm.isend(mine, replicas.buddy(me, world, c.stride), tag=_TAG + i))
    commits.copy_polling(c.own, pieces, works)
    if own is not None:
        own.finish(c.gen)
    return works


def one_slot(state: Any) -> bool:
    """Whether the commits of ``state``'s ZeroOptimizer take the place of the previous one (every
    replica and live shard in shared memory over its communicator)."""
    known, shared = state._shared
    return shared is not None and shared.live and known is state.optimizer.comm


def _shared_over(state: Any, comm: Any, stride: int, originals: list[torch.Tensor]) -> Any:
    """What goes through shared memory with the buddy and the ward over ``comm``, set up at the
    first commit over it or when the shard's tensors change (point to point with both, and one
    all-reduce over ``comm``). When all of it does (one host), this rank's live shard is moved
    into its segment, where the buddy sees it."""
    known, shared = state._shared
    if known is comm and shared is not None and shared.fits(originals):
        return shared
    hosts = domains.hosts(state)
    me, world = int(comm.rank), int(comm.size)
    buddy, ward = replicas.buddy(me, world, stride), replicas.ward(me, world, stride)
    shared = shm.setup(comm, buddy, ward, hosts[buddy] == hosts[me], hosts[ward] == hosts[me], originals,
                       live=state._plain_zero)
    state._shared = (comm, shared)
    if shared.live:
        keep_live(state, state.optimizer)
        if state._live_hooked is not state.optimizer:
            me_ref = weakref.ref(state)

            def after_update(o: Any) -> None:
                s = me_ref()
                if s is not None:
                    keep_live(s, o)
            state.optimizer.register_update_post_hook(after_update)
            state._live_hooked = state.optimizer
    return shared


@torch.no_grad()
def keep_live(state: Any, opt: Any) -> None:
    """Keep the live shard in its shared-memory area: tensors the optimizer made anew since (it
    updates in place as a rule) are copied there and rebound to it."""
    known, shared = state._shared
    if opt is not state.optimizer or shared is None or not shared.live or known is not opt.comm:
        return
    originals = live_pieces(opt)[0]
    if not shared.fits(originals):
        return                  # other tensors: the next commit sets the segments up again
    for t, area in zip(originals, shared.own.live_pieces()):
        if t.data_ptr() != area.data_ptr():
            area.copy_(t.reshape(-1))
            t.set_(area.view(t.shape))
