"""TorchState: the training state that a recovery rolls back to, kept in memory per commit."""
from __future__ import annotations

import os
import time
import weakref
from typing import Any, Callable, Iterable

import torch

from . import domains, epoch, fsdp, gradrep, rollback, sharded, values
from .commit import Commit

#: Attributes of the state itself (anything else set on it is replicated state).
_FIELDS = frozenset({"model", "optimizer", "checkpoint_dir", "checkpoint_every", "failure_domain", "replicate",
                     "commit_seconds", "replicate_seconds", "recoveries", "growths", "resumed"})
_FIXED = frozenset({"checkpoint_dir", "checkpoint_every", "failure_domain", "replicate"})
#: How a ZeroOptimizer's shards reach the buddy: the state each commit, or the gradient each step.
REPLICATE = ("state", "gradient")


def _is_zero(opt: Any) -> bool:
    try:
        from zero import ZeroOptimizer
    except ImportError:  # pragma: no cover
        return False
    return isinstance(opt, ZeroOptimizer)


def _plain_zero(opt: Any) -> bool:
    """A ZeroOptimizer of a plain torch optimizer (1-bit Adam's compressed steps are collective:
    no buddy can replay them)."""
    if not _is_zero(opt):
        return False
    from zero.inner import is_onebit

    return not is_onebit(opt.optimizer_class)


class TorchState:
    """Model, optimizer and any attributes, committed in memory so a recovery can roll back.

    ``state.commit()`` keeps a copy of the replicated state (model weights, a plain optimizer's
    state, the attributes, the global torch / numpy / ``random`` generators) on this rank and,
    for a ``zero.ZeroOptimizer``, sends this rank's shard to its buddy rank and keeps its ward's
    (the buddy is ``replica_stride`` ranks on: the next rank, or the first shift that puts every
    buddy in another failure domain, so that a host lost whole loses no shard;
    ``failure_domain`` names this rank's, default the host's name). The last two commits are
    held, so every survivor can roll back to the newest one that all of them completed.
    A buddy on the same host maps the rank's copy in shared memory instead (``elastic.shm``);
    when every buddy does, each rank's live shard moves there too and one commit is held (the
    commit is agreed first under ULFM: ``elastic.epoch``).
    ``replicate="gradient"`` (a ZeroOptimizer of a plain torch optimizer): each step sends the
    averaged gradient shard to the buddy instead, which replays the rank's update at the commit
    (``elastic.gradrep``); one commit is held, agreed under ULFM.
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
        fixed = {"checkpoint_dir": None if checkpoint_dir is None else os.path.abspath(os.fspath(checkpoint_dir)),
                 "checkpoint_every": checkpoint_every, "failure_domain": failure_domain, "replicate": replicate}
        self.__dict__.update(fixed)
        self._attrs: dict[str, Any] = {}        # the user's replicated attributes
        self._fsdp = fsdp.uses_dtensors(model)  # FSDP2: see elastic.fsdp
        self._fsdp_pending: Any = None
        self._strides: tuple[Any, int, list[int]] = (None, 1, [])  # (communicator, its replica stride, host ids)
        self._shared: tuple[Any, Any] = (None, None)   # (communicator, elastic.shm.Shared over it)
        self._live_hooked: Any = None           # the ZeroOptimizer sharded.keep_live watches
        self._hooked: Any = None                # the ZeroOptimizer gradrep.before_update sees
        self._trained_hooked: Any = None        # the optimizer whose updates set _trained
        self._trained = False                   # an update ran on this rank since the run began
        self._count = 0                         # user commits so far (restored by a resume)
        self._saving: Any = None                # the ckpt.SaveHandle in flight
        self._epoch: Any = None                 # the communicator the next commit agrees over (ULFM)
        self._growing: Any = None               # elastic.grow.Pending: replacements starting
        self._spawn_due = False                 # replacements (or a spare) start at the next commit
        self._dist = False                      # torch.distributed's default group seen (_uses_dist)
        # elastic.run's settings, set by it (a replacement takes the job's when it joins)
        self._min_world_size, self._max_world_size, self._wait, self._spare = 1, None, False, False
        self._callbacks: list[Callable[[], Any]] = []
        self._commits: list[Commit] = []        # oldest first, at most two
        self.model = model
        self.optimizer = optimizer
        self.resumed: Any = None                # what the resume from checkpoint_dir loaded
        if comm is None and _is_zero(optimizer):
            comm = optimizer.comm
        self._comm = mpicomm.as_communicator(comm)
        self.commit_seconds = 0.0
        self.replicate_seconds = 0.0            # in steps: own copies, gradient exchanges
        self.recoveries: list[dict[str, Any]] = []   # one dict per recovery: lost ranks, timings
        self.growths: list[dict[str, Any]] = []      # one dict per growth: ranks spawned, timings
        for k, v in attrs.items():
            setattr(self, k, v)
        epoch.open(self)

    # -- attributes ------------------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name in _FIELDS:
            if name in _FIXED:
                raise AttributeError(f"elastic.TorchState: {name} is fixed at construction")
            object.__setattr__(self, name, value)
            if name == "optimizer":
                self._watch_updates()
            return
        values.check(name, value)
        self._attrs[name] = value

    def __getattr__(self, name: str) -> Any:
        attrs = self.__dict__.get("_attrs")
        if attrs is not None and name in attrs:
            return attrs[name]
        raise AttributeError(f"elastic.TorchState has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__.get("_attrs", {}):
            del self._attrs[name]
        else:
            object.__delattr__(self, name)

    @property
    def _names(self) -> list[str]:
        """The replicated attributes' names, in the order they were first set."""
        return list(self._attrs)

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
        """Run ``callbacks`` (no arguments, in order) after every recovery or growth, before
        ``train`` again."""
        for fn in callbacks:
            if not callable(fn):
                raise TypeError(f"elastic.TorchState.register_reset_callbacks: expected callables, got {fn!r}")
            self._callbacks.append(fn)

    def _uses_dist(self) -> bool:
        """Whether the job uses torch.distributed's default group, which a recovery or a join
        makes anew: remembered, because one cut short by a failure leaves no group."""
        import torch.distributed as dist

        self._dist = self._dist or bool(dist.is_available() and dist.is_initialized())
        return self._dist

    def _run_callbacks(self) -> str | None:
        """Run the reset callbacks in order; what the first that raised said, or None."""
        for fn in self._callbacks:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - reported on every rank by the caller
                return f"{getattr(fn, '__qualname__', repr(fn))}: {type(e).__name__}: {e}"
        return None

    def check_host_updates(self) -> None:
        """Raise ``elastic.HostsUpdatedInterrupt`` on every rank when slots were added to the
        job (``MPICOMM_ELASTIC_HOSTS``'s discovery) and ``elastic.run(max_world_size=...)``
        allows more ranks: ``elastic.run`` then grows the job at this commit (collective)."""
        from . import grow

        grow.check_host_updates(self)

    @property
    def growing(self) -> bool:
        """Whether the job is growing back: replacements start at the next ``commit()`` (after a
        recovery) or are starting, and join at a coming one (a spare waiting while the job is
        at full size is not a growth)."""
        from . import grow

        return grow.due(self)

    @property
    def sharded(self) -> bool:
        """Whether the optimizer is a ZeroOptimizer (its state is replicated to a buddy rank)."""
        return _is_zero(self.optimizer)

    @property
    def _plain_zero(self) -> bool:
        return _plain_zero(self.optimizer)

    @property
    def generation(self) -> int:
        """How many commits this rank completed since the world last changed (0: none yet)."""
        return self._commits[-1].gen if self._commits else 0

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

    def replica_bytes(self) -> int:
        """Bytes this rank holds in commits (both generations; with a ZeroOptimizer of a plain
        torch optimizer one: its own copy, its ward's replica and gradient)."""
        return sum(c.nbytes() for c in self._commits)

    def _watch_updates(self) -> None:
        """Note the first update of the optimizer on this rank (after it, the state before any
        update is gone: ``elastic.rollback``)."""
        opt = self.__dict__.get("optimizer")
        if opt is None or self.__dict__.get("_trained_hooked") is opt or not hasattr(opt, "register_step_pre_hook"):
            return
        me = weakref.ref(self)

        def mark(*_: Any) -> None:
            s = me()
            if s is not None:
                s._trained = True
        if _is_zero(opt):
            opt.register_update_pre_hook(mark)      # after the gradient reduction, before the update
        else:
            opt.register_step_pre_hook(mark)
        object.__setattr__(self, "_trained_hooked", opt)

    # -- commit ----------------------------------------------------------------------------------

    @property
    def commits(self) -> int:
        """User commits since the run began (carried over by a resume from ``checkpoint_dir``)."""
        return self._count

    @torch.no_grad()
    def commit(self) -> None:
        """Keep the current state as what a recovery rolls back to (collective with a ZeroOptimizer);
        with ``checkpoint_dir``, every ``checkpoint_every``-th commit also starts an async ckpt save.
        Replacements spawned by ``elastic.run(max_world_size=...)`` join at a commit: it then
        raises ``elastic.grow.Regrouped``, which ``elastic.run`` catches to call ``train`` again."""
        self._commit(self._count + 1)
        if self.checkpoint_dir is not None and self._count % self.checkpoint_every == 0:
            from . import disk

            self.wait_checkpoint()      # (ckpt.save would wait for it too) and the leftovers go
            self._saving = disk.save(self, self._count)
        if self._spawn_due or self._growing is not None:
            from . import grow

            grow.at_commit(self)        # replacements start, or join once all are ready

    def wait_checkpoint(self) -> None:
        """Wait for the checkpoint save in flight, if any (raises its failure on every rank); once
        it succeeded, rank 0 removes what saves cut short left in ``checkpoint_dir``."""
        handle = self._saving
        if handle is not None:
            handle.wait()           # a failure leaves it in _saving, for the recovery to settle
            self._saving = None
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
        self._count = info["commits"]
        self.resumed = info
        self._commits.clear()

    @torch.no_grad()
    def _commit(self, count: int) -> None:
        t0 = time.perf_counter()
        gen = self.generation + 1
        if self.replicate == "gradient":
            c = gradrep.commit(self, gen, count)
            self._commits[:] = [c]
        else:
            self._commit_state(gen, count)
        self._count = count
        self.commit_seconds += time.perf_counter() - t0

    def _commit_state(self, gen: int, count: int) -> None:
        """A commit of the whole state (``replicate="state"``): copies here, shards to the buddy."""
        if self.sharded:    # every survivor commits, or none does, where the slot is overwritten
            epoch.agree(self, self.optimizer.comm, True, gen)
        # the oldest commit is dropped now and its memory reused (no fresh pages to fault in)
        old = self._commits.pop(0) if len(self._commits) == 2 else Commit(0)
        c = Commit(gen, count, world=self.world_size)
        if self.sharded or self._fsdp:
            c.stride = domains.stride(self, self.optimizer.comm if self.sharded else self._comm)
        # the shard pieces leave for the buddy first; the local copies are made while they travel
        works = sharded.send_shards(self, c, old) if self.sharded else []
        if self._fsdp:
            c.fsdp, works = fsdp.commit(self, old.fsdp, c.stride)
        self._copy_replicated(c, old)
        if not self.sharded and not self._fsdp and self.optimizer is not None:
            c.optimizer = values.state_dict_copy(self.optimizer, old.optimizer)
        for w in works:
            w.wait()
        self._commits.append(c)
        if c.own_shm is not None and c.own_shm.live and not c.new_segments:
            # one slot: this commit took the previous one's place (agreed above). One that set new
            # segments up ran a collective, which a failure may have cut short on some survivors
            # only: the previous commit, in the old segments, stays until the next commit.
            del self._commits[:-1]

    def _copy_replicated(self, c: Commit, old: Commit | None = None) -> None:
        """Copy the attributes, the model's replicated entries and the global generators into ``c``."""
        for name, value in self._attrs.items():
            c.attrs[name] = values.save(value, old.attrs.get(name) if old is not None else None)
        if self.model is not None and not self._fsdp:
            c.model = values.tree_copy(self._model_entries(), old.model if old is not None else None)
        if self.sharded:    # what an LR scheduler set (a plain optimizer's are in its state_dict)
            c.hyper = values.tree_copy([{k: v for k, v in g.items() if k != "params"}
                                        for g in self.optimizer.param_groups])
        c.rng = values.get_global_rng()

    def _model_entries(self) -> dict[str, Any]:
        """The model's state to copy: all of it, except the weights a ZeroOptimizer holds (its
        fp32 masters are copied and replicated instead, and gathered back into the model)."""
        sd = self.model.state_dict(keep_vars=True)
        if not self.sharded:
            return sd
        held = {id(p) for g in self.optimizer.groups for p in g.params}
        return {k: v for k, v in sd.items() if id(v) not in held}

    def _live_pieces(self) -> tuple[list[torch.Tensor], list[list[str]], list[dict[str, Any]]]:
        return sharded.live_pieces(self.optimizer)

    # -- rollback (run by elastic.run on every survivor) ----------------------------------------

    def _rollback(self, gen: int, new_comm: Any, survivors: list[int], old_world: int) -> None:
        """Restore generation ``gen`` over ``new_comm`` (the survivors, old ranks ``survivors``)."""
        rollback.restore(self, gen, new_comm, survivors, old_world)

    @torch.no_grad()
    def _restart_from_disk(self, new_comm: Any) -> dict[str, Any] | None:
        """Carry on over ``new_comm`` from the newest checkpoint of ``checkpoint_dir`` (after a
        shard and its replica were both lost); returns what was loaded. An FSDP2 model is
        loaded later, into the one ``RebuildFSDP`` builds on the survivors (returns None)."""
        self._comm = new_comm
        self.resumed = None
        self._commits.clear()
        if self._fsdp:
            self._fsdp_pending = {"disk": True}
            return None
        if self.sharded:    # re-partitioned over the survivors with placeholders; the load fills every shard
            opt = self.optimizer
            opt.rebind(new_comm, [(torch.zeros(lay.local_numel, dtype=torch.float32), {}, {})
                                  for lay in opt.layouts_for(int(new_comm.size))])
        self._resume()
        if self.resumed is None:
            raise RuntimeError(f"elastic: {self.checkpoint_dir} holds no committed checkpoint")
        self._commit(self._count)
        return self.resumed
