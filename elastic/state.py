"""TorchState: the training state that a recovery rolls back to, kept in memory per commit."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from . import fsdp, gradrep, repartition, replicas, reshard, shm, values

_OWN = frozenset({"model", "optimizer", "checkpoint_dir", "checkpoint_every", "failure_domain", "replicate"})
#: How a ZeroOptimizer's shards reach the buddy: the state each commit, or the gradient each step.
REPLICATE = ("state", "gradient")
_TAG = 29029


@dataclass
class Commit:
    """One commit as this rank holds it."""

    gen: int
    count: int = 0                        # user commits since the run began (checkpoint_every counts them)
    stride: int = 1                       # sharded state: the replica is on the rank this many on
    model: Any = None                     # model.state_dict() copy (replicated)
    optimizer: Any = None                 # plain optimizer: state_dict() copy (replicated)
    attrs: dict[str, Any] = field(default_factory=dict)
    own: list[torch.Tensor] = field(default_factory=list)      # ZeroOptimizer: this rank's shard pieces
    ward: list[torch.Tensor] = field(default_factory=list)     # ZeroOptimizer: the previous rank's pieces
    # ZeroOptimizer of a plain torch optimizer (replicated by gradient, elastic.gradrep):
    own_live: bool = False                # ``own`` is the live shard itself (no update since this commit)
    own_copy: list[torch.Tensor] = field(default_factory=list)  # what ``own`` is copied into before an update
    grad: list[torch.Tensor] = field(default_factory=list)      # the ward's gradient of the first update since
    grad_hp: Any = None                   # (the ward's hyperparameters, which groups had a gradient) of that update
    updates: int = 0                      # shard updates since this commit
    comm: Any = None                      # the ZeroOptimizer's communicator it was made over
    kind: str = "state"                   # "state", or a ZeroOptimizer's "gradient" / "full" (elastic.gradrep)
    other: list[dict[str, Any]] = field(default_factory=list)  # ZeroOptimizer: per group, its non-elementwise state
    keys: list[list[str]] = field(default_factory=list)        # ZeroOptimizer: per group, its elementwise state names
    fsdp: Any = None                      # FSDP2 model: elastic.fsdp.commit's packed shards and the rest
    own_shm: Any = None                   # elastic.shm.Segment ``own`` lies in (mapped by the buddy)
    ward_shm: Any = None                  # elastic.shm.Segment ``ward`` is mapped from (the ward's own copy)
    ward_live: list[torch.Tensor] = field(default_factory=list)  # its live shard, when it is kept there
    new_segments: bool = False            # this commit set the shared memory up (a collective: see _commit)

    def nbytes(self) -> int:
        """Bytes of tensors this commit holds (a ward's copy mapped from shared memory is the
        ward's, counted there)."""
        own = [] if self.own_live or self.own is self.own_copy else self.own    # the live shard is not a copy
        ward = [] if self.ward_shm is not None else self.ward
        return (values.nbytes(self.model) + values.nbytes(self.optimizer) + values.nbytes(self.attrs)
                + values.nbytes(own) + values.nbytes(self.own_copy) + values.nbytes(ward)
                + values.nbytes(self.grad) + values.nbytes(self.fsdp))

    def ward_whole(self) -> bool:
        """Whether the ward's copy of this commit is whole (one mapped from shared memory may
        have been overwritten by a later commit of the ward, or cut short by its death)."""
        return self.ward_shm is None or self.ward_shm.holds(self.gen)

    def ward_pieces(self) -> list[torch.Tensor]:
        """The ward's shard at this commit, when the ward is lost: its copy, or, where its live
        shard is kept in shared memory and it died before it finished this commit's copy, that
        live shard (what the copy was of: nothing changes it between a step and its commit)."""
        if self.ward_whole() or not self.ward_live:
            return self.ward
        return self.ward_live


def _plain_zero(opt: Any) -> bool:
    """A ZeroOptimizer of a plain torch optimizer (1-bit Adam's compressed steps are collective:
    no buddy can replay them)."""
    if not _is_zero(opt):
        return False
    from zero.inner import is_onebit

    return not is_onebit(opt.optimizer_class)


def _is_zero(opt: Any) -> bool:
    try:
        from zero import ZeroOptimizer
    except ImportError:  # pragma: no cover
        return False
    return isinstance(opt, ZeroOptimizer)


class TorchState:
    """Model, optimizer and any attributes, committed in memory so a recovery can roll back.

    ``state.commit()`` keeps a copy of the replicated state (model weights, a plain optimizer's
    state, the attributes) on this rank and, for a ``zero.ZeroOptimizer``, sends this rank's
    shard to its buddy rank and keeps its ward's (the buddy is ``replica_stride`` ranks on:
    the next rank, or the first shift that puts every buddy in another failure domain, so that
    a host lost whole loses no shard; ``failure_domain`` names this rank's, default the host's
    name). The last two commits
    are held, so every survivor can roll back to the newest one that all of them completed.
    A buddy on the same host maps the rank's copy in shared memory instead (``elastic.shm``);
    when every buddy does, each rank's live shard moves there too and one commit is held.
    ``replicate="gradient"`` (a ZeroOptimizer of a plain torch optimizer): each step sends the
    averaged gradient shard to the buddy instead, which replays the rank's update at the commit
    (``elastic.gradrep``); one commit is held (own copy, ward's replica and gradient: 2.33
    shards with Adam instead of four), agreed over the optimizer's communicator under ULFM so
    that it happened on every survivor or on none. It holds less memory; whether it costs less
    time depends on the machine (docs/elastic.md).
    An FSDP2 model (``fully_shard`` on a 1-D mesh) has its local DTensor shards (parameters and
    optimizer state) replicated the same way; register ``elastic.RebuildFSDP(state, build)`` to
    build it anew on the survivors' mesh after a recovery (see ``elastic.fsdp``).
    Attributes given as keywords (``step=0``) or set later are replicated state; one that cannot
    be copied raises ``TypeError`` naming it.

    ``checkpoint_dir=DIR, checkpoint_every=K``: every K-th commit also starts an async
    ``ckpt.save`` into ``DIR/step<N>`` (N: the commits so far; ``DIR/latest`` names the newest);
    ``elastic.run`` first resumes from the newest one at the current world size.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 checkpoint_dir: str | None = None, checkpoint_every: int | None = None,
                 comm: Any = None, failure_domain: str | None = None, replicate: str = "state",
                 **attrs: Any) -> None:
        import mpicomm

        if failure_domain is not None and not (isinstance(failure_domain, str) and failure_domain):
            raise TypeError(f"elastic.TorchState: expected failure_domain a non-empty str or None, got "
                            f"{failure_domain!r}")

        if (checkpoint_dir is None) != (checkpoint_every is None):
            raise ValueError("elastic.TorchState: checkpoint_dir and checkpoint_every go together; got "
                             f"checkpoint_dir={checkpoint_dir!r}, checkpoint_every={checkpoint_every!r}")
        if checkpoint_every is not None and (isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int)
                                             or checkpoint_every < 1):
            raise ValueError(f"elastic.TorchState: expected checkpoint_every an int >= 1, got {checkpoint_every!r}")
        if checkpoint_dir is not None and model is None:
            raise ValueError("elastic.TorchState: checkpoint_dir needs a model (ckpt saves a model)")
        if replicate not in REPLICATE:
            raise ValueError(f"elastic.TorchState: expected replicate one of {REPLICATE}, got {replicate!r}")
        if replicate == "gradient" and not _plain_zero(optimizer):
            raise ValueError("elastic.TorchState: replicate='gradient' needs a zero.ZeroOptimizer of a plain "
                             f"torch optimizer (its buddy replays the update); got {type(optimizer).__name__}"
                             + (f" of {optimizer.optimizer_class.__name__}" if _is_zero(optimizer) else ""))
        object.__setattr__(self, "_fsdp", fsdp.uses_dtensors(model))    # FSDP2: see elastic.fsdp
        object.__setattr__(self, "_fsdp_pending", None)
        object.__setattr__(self, "_names", [])
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "checkpoint_dir", None if checkpoint_dir is None
                           else os.path.abspath(os.fspath(checkpoint_dir)))
        object.__setattr__(self, "checkpoint_every", checkpoint_every)
        object.__setattr__(self, "failure_domain", failure_domain)
        object.__setattr__(self, "replicate", replicate)
        object.__setattr__(self, "_strides", (None, 1, []))  # (communicator, its replica stride, host ids)
        object.__setattr__(self, "_shared", (None, None))    # (communicator, elastic.shm.Shared over it)
        object.__setattr__(self, "_live_hooked", None)       # the ZeroOptimizer _keep_live watches
        object.__setattr__(self, "_count", 0)           # user commits so far (restored by a resume)
        object.__setattr__(self, "_saving", None)       # the ckpt.SaveHandle in flight
        object.__setattr__(self, "resumed", None)       # what the resume from checkpoint_dir loaded
        if comm is None and _is_zero(optimizer):
            comm = optimizer.comm
        object.__setattr__(self, "_comm", mpicomm.as_communicator(comm))
        object.__setattr__(self, "_callbacks", [])
        object.__setattr__(self, "_commits", [])   # oldest first, at most two (one replicated by gradient)
        object.__setattr__(self, "_hooked", None)  # the ZeroOptimizer whose updates _before_update sees
        object.__setattr__(self, "_epoch", None)   # the communicator the next commit agrees over (ULFM)
        object.__setattr__(self, "commit_seconds", 0.0)
        object.__setattr__(self, "replicate_seconds", 0.0)   # in steps: own copies, gradient exchanges
        object.__setattr__(self, "recoveries", [])  # one dict per recovery: lost ranks, timings
        for k, v in attrs.items():
            setattr(self, k, v)
        self._open_epoch()

    # -- attributes ------------------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name in _OWN or name in ("commit_seconds", "replicate_seconds", "recoveries",
                                                            "resumed"):
            if name in ("checkpoint_dir", "checkpoint_every", "failure_domain", "replicate"):
                raise AttributeError(f"elastic.TorchState: {name} is fixed at construction")
            object.__setattr__(self, name, value)
            return
        values.check(name, value)
        if name not in self._names:
            self._names.append(name)
        object.__setattr__(self, name, value)

    @property
    def comm(self) -> Any:
        """The communicator of the ranks training now (the survivors after a recovery)."""
        return self._comm

    @property
    def rank(self) -> int:
        """This rank in ``comm``."""
        return int(self._comm.rank)

    @property
    def world_size(self) -> int:
        """Ranks in ``comm``."""
        return int(self._comm.size)

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Run ``callbacks`` (no arguments, in order) after every recovery, before ``train`` again."""
        for fn in callbacks:
            if not callable(fn):
                raise TypeError(f"elastic.TorchState.register_reset_callbacks: expected callables, got {fn!r}")
            self._callbacks.append(fn)

    @property
    def sharded(self) -> bool:
        """Whether the optimizer is a ZeroOptimizer (its state is replicated to a buddy rank)."""
        return _is_zero(self.optimizer)

    @property
    def generation(self) -> int:
        """How many commits this rank completed (0: none yet)."""
        return self._commits[-1].gen if self._commits else 0

    def _rollback_generation(self, old_rank: int, old_world: int, survivors: list[int]) -> int:
        """The newest commit this rank holds whole for a recovery over ``survivors`` (old
        ranks): when its ward was lost, the ward's copy must be whole (one mapped from shared
        memory may have been overwritten or cut short by the ward); 0 if none."""
        for c in reversed(self._commits):
            if old_world < 2 or replicas.ward(old_rank, old_world, c.stride) in survivors or c.ward_whole() \
                    or c.ward_live:
                return c.gen
        return 0

    @property
    def commit_kind(self) -> str | None:
        """How the newest commit kept the ZeroOptimizer shards: ``"gradient"`` (the buddy replayed
        the update whose gradient it received), ``"full"`` (the shards were sent; elastic.gradrep
        says when), ``"state"`` (1-bit Adam, FSDP2 or no sharded state: copies and full
        replicas); None before the first commit."""
        return self._commits[-1].kind if self._commits else None

    @property
    def replica_stride(self) -> int:
        """How many ranks on (cyclically) the newest commit's shard replicas went: 1, or the
        shift that puts every rank's buddy in another failure domain."""
        return self._commits[-1].stride if self._commits else 1

    def _stride(self, comm: Any) -> int:
        """The replica stride over ``comm`` from every rank's failure domain (collective, once
        per communicator): ``failure_domain``, else the host's name."""
        known, value, _ = self._strides
        if known is not comm:
            import hashlib

            from mpi4py import MPI

            def tag(name: str) -> int:
                return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little", signed=True)
            host = MPI.Get_processor_name()
            ids = torch.zeros(2 * int(comm.size), dtype=torch.int64)
            comm.all_gather_into_tensor(ids, torch.tensor([tag(self.failure_domain or host), tag(host)],
                                                          dtype=torch.int64))
            value = replicas.stride(ids[0::2].tolist())
            object.__setattr__(self, "_strides", (comm, value, ids[1::2].tolist()))
        return value

    def replica_bytes(self) -> int:
        """Bytes this rank holds in commits (both generations; with a ZeroOptimizer of a plain
        torch optimizer one: its own copy, its ward's replica and gradient)."""
        return sum(c.nbytes() for c in self._commits)

    @property
    def _by_gradient(self) -> bool:
        """Whether the ZeroOptimizer's shards are replicated by gradient (``replicate="gradient"``)."""
        return self.replicate == "gradient"

    def _open_epoch(self) -> None:
        """Under ULFM, the next commit agrees (``Communicator.agree``) over the ZeroOptimizer's
        communicator so that it happens on every survivor or on none; a recovery that starts
        before it joins that agreement with False (``_close_epoch``)."""
        comm = self.optimizer.comm if self._by_gradient else None
        object.__setattr__(self, "_epoch", comm if getattr(comm, "fault_tolerant", False) else None)

    def _close_epoch(self) -> None:
        """At the start of a recovery: join the agreement the next commit would have made, as
        False (survivors inside that commit's agreement are waiting for it; collective)."""
        comm = self._epoch
        object.__setattr__(self, "_epoch", None)
        if comm is not None:
            comm.agree(False)

    # -- commit ----------------------------------------------------------------------------------

    @property
    def commits(self) -> int:
        """User commits since the run began (carried over by a resume from ``checkpoint_dir``)."""
        return self._count

    @torch.no_grad()
    def commit(self) -> None:
        """Keep the current state as what a recovery rolls back to (collective with a ZeroOptimizer);
        with ``checkpoint_dir``, every ``checkpoint_every``-th commit also starts an async ckpt save."""
        self._commit(self._count + 1)
        if self.checkpoint_dir is not None and self._count % self.checkpoint_every == 0:
            from . import disk

            self.wait_checkpoint()      # (ckpt.save would wait for it too) and the leftovers go
            object.__setattr__(self, "_saving", disk.save(self, self._count))

    def wait_checkpoint(self) -> None:
        """Wait for the checkpoint save in flight, if any (raises its failure on every rank); once
        it succeeded, rank 0 removes what saves cut short left in ``checkpoint_dir``."""
        handle = self._saving
        if handle is not None:
            handle.wait()           # a failure leaves it in _saving, for the recovery to settle
            object.__setattr__(self, "_saving", None)
            self._sweep()

    def _sweep(self) -> None:
        """Rank 0 removes the working directories of saves cut short (none is in flight now)."""
        from . import disk

        if self.checkpoint_dir is not None and self.rank == 0:
            disk.sweep(self.checkpoint_dir)

    def _resume(self) -> None:
        """Load the newest checkpoint of ``checkpoint_dir`` at the current world size, if it holds one."""
        from . import disk

        if self.checkpoint_dir is None:
            return
        self._sweep()       # no save of this run is in flight at a resume
        if not disk.newest_exists(self, self._comm):
            return
        info = disk.load(self)
        object.__setattr__(self, "_count", info["commits"])
        object.__setattr__(self, "resumed", info)
        self._commits.clear()

    @torch.no_grad()
    def _commit(self, count: int) -> None:
        if self._by_gradient:
            self._commit_zero(count)
            return
        t0 = time.perf_counter()
        # the oldest commit is dropped now and its memory reused (no fresh pages to fault in)
        old = self._commits.pop(0) if len(self._commits) == 2 else Commit(0)
        c = Commit(self.generation + 1, count)
        if self.sharded or self._fsdp:
            c.stride = self._stride(self.optimizer.comm if self.sharded else self._comm)
        # the shard pieces leave for the buddy first; the local copies are made while they travel
        works = self._send_shards(c, old) if self.sharded else []
        if self._fsdp:
            c.fsdp, works = fsdp.commit(self, old.fsdp, c.stride)
        for name in self._names:
            c.attrs[name] = values.save(getattr(self, name), old.attrs.get(name))
        if self.model is not None and not self._fsdp:
            c.model = values.tree_copy(self._model_entries(), old.model)
        if not self.sharded and not self._fsdp and self.optimizer is not None:
            c.optimizer = values.state_dict_copy(self.optimizer, old.optimizer)
        for w in works:
            w.wait()
        self._commits.append(c)
        if c.own_shm is not None and c.own_shm.live and not c.new_segments:
            # one slot: this commit took the previous one's place. One that set new segments up
            # ran a collective, which a failure may have cut short on some survivors only: the
            # previous commit, in the old segments, stays until the next commit.
            del self._commits[:-1]
        object.__setattr__(self, "_count", count)
        object.__setattr__(self, "commit_seconds", self.commit_seconds + time.perf_counter() - t0)

    def _model_entries(self) -> dict[str, Any]:
        """The model's state to copy: all of it, except the weights a ZeroOptimizer holds (its
        fp32 masters are copied and replicated instead, and gathered back into the model)."""
        sd = self.model.state_dict(keep_vars=True)
        if not self.sharded:
            return sd
        held = {id(p) for g in self.optimizer.groups for p in g.params}
        return {k: v for k, v in sd.items() if id(v) not in held}

    def _live_pieces(self) -> tuple[list[torch.Tensor], list[list[str]], list[dict[str, Any]]]:
        """This rank's live shard as a flat list (per group: the master, then the elementwise
        optimizer state by name), the names, and a copy of each group's other state (``step``)."""
        opt = self.optimizer
        pieces, keys, other = [], [], []
        for gi, g in enumerate(opt.groups):
            elementwise, rest = reshard.split_state(opt.shard_state(gi), g.master)
            names = sorted(elementwise)
            keys.append(names)
            other.append(values.save(rest)[1])
            pieces.append(g.master)
            pieces.extend(elementwise[k] for k in names)
        return pieces, keys, other

    def _ensure_hook(self) -> None:
        opt = self.optimizer
        if self._hooked is opt:
            return
        import weakref

        me = weakref.ref(self)

        def before_update(o: Any) -> None:
            state = me()
            if state is not None:
                state._before_update(o)
        opt.register_update_pre_hook(before_update)
        object.__setattr__(self, "_hooked", opt)

    @torch.no_grad()
    def _before_update(self, opt: Any) -> None:
        """Before the first shard update after a commit: copy the shard (what a rollback to the
        commit needs once it changes) and exchange the averaged gradient shards and the update's
        hyperparameters with the buddies (the transfers travel while the copy runs)."""
        if opt is not self.optimizer or not self._commits or self._commits[-1].comm is None:
            return
        c = self._commits[-1]
        c.updates += 1
        if c.updates != 1 or not c.own_live:
            return
        t0 = time.perf_counter()
        comm, world = opt.comm, int(opt.comm.size)
        works: list[Any] = []
        if world > 1 and comm is c.comm:
            hp = opt.update_hyperparams()
            grads = [g.master.grad for g in opt.groups]
            vec = gradrep.encode(hp, [g is not None for g in grads])
            inbox = torch.empty_like(vec)
            c.grad = _buffers_like([g.master for g in opt.groups], c.grad)
            me = int(comm.rank)
            buddy, ward = replicas.buddy(me, world, c.stride), replicas.ward(me, world, c.stride)
            works.append(comm.irecv(inbox, ward, tag=gradrep.TAG))
            works.append(comm.isend(vec, buddy, tag=gradrep.TAG))
            for i, (theirs, mine, g) in enumerate(zip(c.grad, grads, opt.groups)):
                works.append(comm.irecv(theirs, ward, tag=gradrep.TAG + 1 + i))
                mine = torch.zeros_like(g.master) if mine is None else mine.detach()
                works.append(comm.isend(mine, buddy, tag=gradrep.TAG + 1 + i))
        c.own_copy = _buffers_like(c.own, c.own_copy)
        _copy_polling(c.own_copy, c.own, works)
        c.own, c.own_live = c.own_copy, False
        for w in works:
            w.wait()
        if works:
            c.grad_hp = gradrep.decode(inbox, hp)     # before the update: a mismatch fails the step
        object.__setattr__(self, "replicate_seconds", self.replicate_seconds + time.perf_counter() - t0)

    @torch.no_grad()
    def _commit_zero(self, count: int) -> None:
        """Commit with a ZeroOptimizer replicated by gradient: the buddy replays the ward's one
        update since the previous commit on its replica, or (elastic.gradrep's rule) the full
        shards are sent. One commit is held; under ULFM the commit is agreed over the
        optimizer's communicator first, so it happens on every survivor or on none."""
        from zero.inner import replay_update

        t0 = time.perf_counter()
        self._ensure_hook()
        opt = self.optimizer
        comm, world = opt.comm, int(opt.comm.size)
        prev = self._commits[-1] if self._commits else None
        c = Commit(self.generation + 1, count, comm=comm)
        c.stride = self._stride(comm)
        live, c.keys, c.other = self._live_pieces()
        live = [t.detach() for t in live]
        by_grad = prev is not None and gradrep.gradient_commit(
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
        for name in self._names:
            c.attrs[name] = values.save(getattr(self, name))
        if self.model is not None:
            c.model = values.tree_copy(self._model_entries())
        error: BaseException | None = None
        try:
            for w in works:
                w.wait()
        except Exception as e:  # noqa: BLE001 - a failure: settled by the agreement below
            if not getattr(comm, "fault_tolerant", False):
                raise
            error = e
            comm.revoke()           # no rank stays inside a transfer of this commit
        done = error is None
        atomic = self._epoch is comm
        if atomic:
            object.__setattr__(self, "_epoch", None)
            done = comm.agree(done)
        if not done:
            if error is not None:
                raise error
            raise RuntimeError(f"elastic: commit {c.gen} did not complete on every rank (a rank failed); "
                               f"rolling back to commit {self.generation}")
        c.kind = "gradient" if by_grad else "full"
        if by_grad:
            assert prev is not None
            hp, flags = prev.grad_hp
            masters, states = gradrep.ward_state(prev.ward, prev.keys, prev.other)
            states = replay_update(opt.optimizer, masters, states,
                                   [g if f else None for g, f in zip(prev.grad, flags)], hp)
            c.ward = gradrep.join(masters, states, c.keys)
        else:
            c.ward = staging
        c.own, c.own_live = live, True
        if prev is not None and prev.comm is comm:
            c.own_copy, c.grad = prev.own_copy, prev.grad      # reused: no fresh pages to fault in
        self._commits[:] = [c]
        if atomic:
            object.__setattr__(self, "_epoch", comm)
        object.__setattr__(self, "_count", count)
        object.__setattr__(self, "commit_seconds", self.commit_seconds + time.perf_counter() - t0)

    def _send_shards(self, c: Commit, old: Commit) -> list[Any]:
        """Start exchanging this rank's shard pieces with the buddies (sent from the live
        tensors, which a commit does not change) and copy them into ``c`` while they travel;
        return the transfers to wait for. Buffers of ``old`` are reused (no allocation). Through
        shared memory (elastic.shm) the copy is the buddy's replica and nothing is sent."""
        opt = self.optimizer
        originals, c.keys, c.other = self._live_pieces()
        comm, world = opt.comm, int(opt.comm.size)
        before = self._shared[1]
        shared = self._shared_over(comm, c.stride, originals) if world > 1 else None
        c.new_segments = shared is not before
        pieces = [t.detach() for t in originals]     # after the move into shared memory, if any
        own = shared.own if shared is not None else None
        if own is not None:         # the buddy maps this rank's copy: nothing to send
            c.own = own.pieces(c.gen)
            own.begin(c.gen)
        else:
            c.own = _buffers_like(pieces, [] if old.own_shm is not None else old.own)
        c.own_shm = own
        works = []
        if world > 1:
            me = int(comm.rank)
            if shared.ward is not None:
                c.ward, c.ward_shm = shared.ward.pieces(c.gen), shared.ward
                c.ward_live = shared.ward.live_pieces() if shared.live else []
            else:
                c.ward = _buffers_like(pieces, [] if old.ward_shm is not None else old.ward)
                for i, theirs in enumerate(c.ward):
                    works.append(comm.irecv(theirs, replicas.ward(me, world, c.stride), tag=_TAG + i))
            if own is None:
                for i, mine in enumerate(pieces):
                    works.append(comm.isend(mine, replicas.buddy(me, world, c.stride), tag=_TAG + i))
        _copy_polling(c.own, pieces, works)
        if own is not None:
            own.finish(c.gen)
        return works

    def _shared_over(self, comm: Any, stride: int, originals: list[torch.Tensor]) -> Any:
        """What goes through shared memory with the buddy and the ward over ``comm``
        (``elastic.shm``), set up at the first commit over it or when the shard's tensors change
        (point to point with both, and one agreement over ``comm``). When all of it does (one
        host), this rank's live shard is moved into its segment, where the buddy sees it."""
        known, shared = self._shared
        if known is comm and shared is not None and shared.fits(originals):
            return shared
        hosts = self._strides[2]
        me, world = int(comm.rank), int(comm.size)
        buddy, ward = replicas.buddy(me, world, stride), replicas.ward(me, world, stride)
        shared = shm.setup(comm, buddy, ward, hosts[buddy] == hosts[me], hosts[ward] == hosts[me], originals,
                           live=_plain_zero(self.optimizer))
        object.__setattr__(self, "_shared", (comm, shared))
        if shared.live:
            self._keep_live(self.optimizer)
            if self._live_hooked is not self.optimizer:
                import weakref

                me_ref = weakref.ref(self)

                def after_update(o: Any) -> None:
                    state = me_ref()
                    if state is not None:
                        state._keep_live(o)
                self.optimizer.register_update_post_hook(after_update)
                object.__setattr__(self, "_live_hooked", self.optimizer)
        return shared

    @torch.no_grad()
    def _keep_live(self, opt: Any) -> None:
        """Keep the live shard in its shared-memory area: tensors the optimizer made anew since
        (it updates in place as a rule) are copied there and rebound to it."""
        known, shared = self._shared
        if opt is not self.optimizer or shared is None or not shared.live or known is not opt.comm:
            return
        originals = self._live_pieces()[0]
        if not shared.fits(originals):
            return                  # other tensors: the next commit sets the segments up again
        for t, area in zip(originals, shared.own.live_pieces()):
            if t.data_ptr() != area.data_ptr():
                area.copy_(t.reshape(-1))
                t.set_(area.view(t.shape))

    # -- rollback (run by elastic.run on every survivor) ----------------------------------------

    def _commit_of(self, gen: int) -> Commit:
        for c in self._commits:
            if c.gen == gen:
                return c
        raise RuntimeError(f"elastic: commit {gen} is not held here (held: {[c.gen for c in self._commits]})")

    @torch.no_grad()
    def _rollback(self, gen: int, new_comm: Any, survivors: list[int], old_world: int) -> None:
        """Restore commit ``gen`` over ``new_comm`` (the survivors, old ranks ``survivors``)."""
        c = self._commit_of(gen)
        for name in self._names:
            object.__setattr__(self, name, values.restore(getattr(self, name), c.attrs[name]))
        if self.model is not None and not self._fsdp:
            self.model.load_state_dict(values.tree_copy(c.model), strict=not self.sharded)
        if self._fsdp:    # loaded into the model rebuilt on the survivors by elastic.RebuildFSDP
            fsdp.rollback(self, c.fsdp, c.count, new_comm, survivors, c.stride)
        elif self.sharded:
            self._rebuild_shards(c, new_comm, survivors, old_world)
            self.optimizer.gather_params()          # the model's weights from the masters
        elif self.optimizer is not None:
            self.optimizer.load_state_dict(values.tree_copy(c.optimizer))
        object.__setattr__(self, "_comm", new_comm)
        # commits of the old world cannot be rebuilt from in the new one: start afresh
        self._commits.clear()
        if not self._fsdp:    # an FSDP2 state is committed by RebuildFSDP once it is rebuilt
            self._commit(c.count)

    @torch.no_grad()
    def _restart_from_disk(self, new_comm: Any) -> dict[str, Any] | None:
        """Carry on over ``new_comm`` from the newest checkpoint of ``checkpoint_dir`` (after a
        shard and its replica were both lost); returns what was loaded. An FSDP2 model is
        loaded later, into the one ``RebuildFSDP`` builds on the survivors (returns None)."""
        if self._fsdp:
            object.__setattr__(self, "_comm", new_comm)
            object.__setattr__(self, "resumed", None)
            self._commits.clear()
            object.__setattr__(self, "_fsdp_pending", {"disk": True})
            return None
        opt = self.optimizer
        # re-partitioned over the survivors with placeholders; the load fills every shard
        opt.rebind(new_comm, [(torch.zeros(lay.local_numel, dtype=torch.float32), {}, {})
                              for lay in opt.layouts_for(int(new_comm.size))])
        object.__setattr__(self, "_comm", new_comm)
        object.__setattr__(self, "resumed", None)
        self._resume()
        if self.resumed is None:
            raise RuntimeError(f"elastic: {self.checkpoint_dir} holds no committed checkpoint")
        self._commit(self._count)
        return self.resumed

    def _rebuild_shards(self, c: Commit, new_comm: Any, survivors: list[int], old_world: int) -> None:
        from .errors import ShardsLostError

        held = replicas.holders(old_world, survivors, c.stride)
        lost = [s for s, h in enumerate(held) if h is None]
        if lost:
            raise ShardsLostError(
                f"elastic: the ZeroOptimizer shards of old ranks {lost} are lost (each rank and its buddy, "
                f"{c.stride} on, both failed; survivors: old ranks {survivors}); no checkpoint_dir to fall back to",
                lost)
        me = survivors[int(new_comm.rank)]
        wards = [s for s, h in enumerate(held) if h == me and s != me]
        if wards and not c.ward_whole() and not c.ward_live:
            raise ShardsLostError(
                f"elastic: the ZeroOptimizer shard of old rank {wards[0]} is lost: its copy in shared "
                f"memory no longer holds commit {c.gen} (that rank was writing a later commit)", wards)
        senders = [survivors.index(h) for h in held]        # the new rank that sends old shard s
        ward = c.ward_pieces() if wards else c.ward
        opt = self.optimizer
        local, i = [], 0
        for gi, (g, layout) in enumerate(zip(opt.groups, opt.layouts_for(int(new_comm.size)))):
            kinds = 1 + len(c.keys[gi])                     # the master, then the elementwise state
            rows = {s: (c.own if s == me else ward)[i:i + kinds] for s, h in enumerate(held) if h == me}
            incoming = reshard.pieces_to(g.layout, layout, int(new_comm.rank))
            outgoing = [p for s in rows for p in reshard.pieces_from(g.layout, layout, s)]
            master, *rest = repartition.exchange(new_comm, incoming, outgoing, rows, senders,
                                                 c.own[i:i + kinds], layout.local_numel)
            local.append((master, dict(zip(c.keys[gi], rest)), values.restore(None, ("value", c.other[gi]))))
            i += kinds
        opt.rebind(new_comm, local)


#: Elements copied between two tests of the exchange in flight (each test moves it along).
COPY_CHUNK = 1 << 20


def _buffers_like(tensors: list[torch.Tensor], reuse: list[torch.Tensor]) -> list[torch.Tensor]:
    """Buffers shaped as ``tensors``: those of ``reuse`` where they match, else fresh ones."""
    olds = reuse if len(reuse) == len(tensors) else [None] * len(tensors)
    return [o if o is not None and o.shape == t.shape and o.dtype == t.dtype and o.device == t.device
            and o.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
            for t, o in zip(tensors, olds)]


def _copy_polling(dst: list[torch.Tensor], src: list[torch.Tensor], works: list[Any]) -> None:
    """Copy ``src`` into ``dst`` in chunks, testing the transfers ``works`` between chunks so that
    MPI moves them on while the copy runs (no progress thread needed)."""
    pending = list(works)
    for d, t in zip(dst, src):
        d, t = d.view(-1), t.reshape(-1)
        for lo in range(0, t.numel(), COPY_CHUNK):
            d[lo:lo + COPY_CHUNK].copy_(t[lo:lo + COPY_CHUNK])
            while pending and pending[0].is_completed():
                pending.pop(0)
