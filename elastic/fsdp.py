"""FSDP2 (``fully_shard``) state in a TorchState: a commit packs the rank's local shards of every
DTensor parameter and optimizer state into one buffer, kept here and sent to the buddy rank; a
recovery re-partitions them over the survivors with the placement rules ckpt uses for N->M
(``ckpt.dtensor_layout``: torch's chunk semantics, uneven last shards included) and
``RebuildFSDP``, a reset callback, loads them into the model and optimizer built anew on the
survivors' mesh. ``plan`` and ``local_shape`` are the pure re-partition step."""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from . import repartition, reshard
from .errors import ElasticError, ShardsLostError


def _dl() -> Any:
    """``ckpt.dtensor_layout``, imported on first use (importing ckpt costs a replacement's start-up 0.3 s)."""
    from ckpt import dtensor_layout

    return dtensor_layout


def local_shape(shape: Sequence[int], world: int, rank: int, placements: Sequence[Any]) -> tuple[int, ...]:
    """The local shard shape of ``rank`` of a tensor of global ``shape`` on a 1-D mesh of ``world``."""
    return _dl().local_shape(_dl().layout(shape, (world,), (rank,), placements))


# -- commit, rollback and rebuild of an FSDP2 model in a TorchState ------------------------------

_TAG = 29129
_ALIGN = 8      # byte offset of every piece in a packed buffer (a uint8 view re-typed needs it)
_HEAD = 8       # a packed buffer starts with the digest of its entries (int64)


def _is_dtensor(t: Any) -> bool:
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not isinstance(t, torch.Tensor):
        return False        # (without importing ckpt)
    from ckpt.dtensor import is_dtensor

    return is_dtensor(t)


def uses_dtensors(model: Any) -> bool:
    """Whether ``model`` has DTensor parameters (FSDP2 ``fully_shard``); raises for layouts that
    elastic cannot re-partition (a mesh of more than one dimension, placements other than Shard)."""
    if model is None:
        return False
    found = False
    for name, p in model.named_parameters():
        if not _is_dtensor(p):
            continue
        found = True
        if p.device_mesh.ndim != 1 or any(_dl().placement_kind(q)[0] != "shard" for q in p.placements):
            raise NotImplementedError(
                f"elastic.TorchState: parameter {name!r} is a DTensor on a {p.device_mesh.ndim}-D mesh with "
                f"placements {tuple(p.placements)}; elastic re-partitions FSDP2 parameters on a 1-D mesh "
                "with Shard placements only (fully_shard(module, mesh=init_device_mesh(dev, (world,))))")
    return found


@dataclass(frozen=True)
class Entry:
    """One sharded tensor of a commit: ``("model", param)`` or ``("optim", param, state key)``."""

    key: tuple[str, ...]
    shape: tuple[int, ...]
    placements: tuple[Any, ...]
    dtype: torch.dtype

    def nbytes(self, world: int, rank: int) -> int:
        """Bytes of ``rank``'s local shard on a 1-D mesh of ``world``, padded to the alignment."""
        n = math.prod(local_shape(self.shape, world, rank, self.placements))
        size = n * self.dtype.itemsize
        return -(-size // _ALIGN) * _ALIGN


def digest(entries: Sequence[Entry]) -> int:
    """A digest of the tensors a commit lists (keys, shapes, placements, dtypes), the same on
    every rank that lists the same ones."""
    text = repr([(e.key, e.shape, [str(p) for p in e.placements], str(e.dtype)) for e in entries])
    return zlib.crc32(text.encode())


def _offsets(entries: Sequence[Entry], world: int, rank: int) -> list[int]:
    """Where each entry's local shard of ``rank`` starts in a packed buffer, and its end."""
    out = [_HEAD]
    for e in entries:
        out.append(out[-1] + e.nbytes(world, rank))
    return out


def _rows(e: Entry, world: int, rank: int) -> tuple[int, int]:
    """The rows of ``e``'s sharded dimension that ``rank`` holds on a 1-D mesh of ``world`` (torch.chunk's)."""
    dim = _dl().placement_kind(e.placements[0])[1]
    return _dl().chunk(e.shape[dim], world, rank)


def _touching(e: Entry, world: int, lo: int, hi: int) -> range:
    """The ranks of a 1-D mesh of ``world`` whose shard of ``e`` holds some of rows [lo, hi)."""
    dim = _dl().placement_kind(e.placements[0])[1]
    full = -(-e.shape[dim] // world) if e.shape[dim] else 0
    return range(lo // full, min(world, (hi - 1) // full + 1)) if hi > lo and full else range(0)


def plan(entries: Sequence[Entry], old_world: int, new_world: int, *, dst: int | None = None,
         srcs: Sequence[int] | None = None) -> list[reshard.Piece]:
    """The byte runs that move from the old ranks' packed buffers (``old_world`` ranks) into the
    new ranks' (``new_world``), every entry laid out by its placement (one ``Shard``) on a 1-D
    mesh of each size. ``dst``: only those landing in that new rank's buffer; ``srcs``: only
    those leaving these old ranks' buffers (either found without the other ranks' runs)."""
    offs: dict[tuple[int, int], list[int]] = {}

    def at(world: int, r: int, i: int) -> int:
        if (world, r) not in offs:
            offs[world, r] = _offsets(entries, world, r)
        return offs[world, r][i]

    old: list[tuple[int, int, int, int]] = []
    new: list[tuple[int, int, int, int]] = []
    base = 0                                    # the entry's first byte in all entries joined
    for i, e in enumerate(entries):
        size = e.dtype.itemsize
        if dst is not None:
            news: Sequence[int] = [dst]
            olds: Sequence[int] = _touching(e, old_world, *_rows(e, new_world, dst))
        elif srcs is not None:
            olds = srcs
            news = sorted({r for s in srcs for r in _touching(e, new_world, *_rows(e, old_world, s))})
        else:
            olds, news = range(old_world), range(new_world)
        for world, ranks, runs in ((old_world, olds, old), (new_world, news, new)):
            for r in ranks:
                for full, local, n in _dl().runs(e.shape, _dl().layout(e.shape, (world,), (r,), e.placements)):
                    runs.append((base + full * size, n * size, r, at(world, r, i) + local * size))
        base += math.prod(e.shape) * size
    return reshard.overlaps(old, new)


def _view(buf: torch.Tensor, e: Entry, lo: int, world: int, rank: int) -> torch.Tensor:
    shape = local_shape(e.shape, world, rank, e.placements)
    n = math.prod(shape) * e.dtype.itemsize
    return buf[lo:lo + n].view(e.dtype).view(shape)


def _names(model: Any) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _check_mesh(state: Any, name: str, p: Any) -> None:
    mesh = p.device_mesh
    coord = mesh.get_coordinate()
    if mesh.size() != state.world_size or coord is None or int(coord[0]) != state.rank:
        raise ValueError(
            f"elastic.TorchState: FSDP2 parameter {name!r} is on a mesh of {mesh.size()} ranks at coordinate "
            f"{coord}; expected a 1-D mesh over all {state.world_size} ranks of state.comm in rank order "
            f"(this rank: {state.rank}), e.g. init_device_mesh(dev, (dist.get_world_size(),))")


def _tensors(state: Any) -> tuple[list[tuple[Entry, torch.Tensor]], dict[str, Any]]:
    """The local shards to replicate (in one order on every rank) and the replicated rest."""
    model, opt = state.model, state.optimizer
    names = _names(model)
    shards: list[tuple[Entry, torch.Tensor]] = []
    plain: dict[str, Any] = {"params": {}, "buffers": dict(model.named_buffers()), "optim": {}, "groups": []}
    for n, p in model.named_parameters():
        if _is_dtensor(p):
            _check_mesh(state, n, p)
            shards.append((Entry(("model", n), tuple(p.shape), tuple(p.placements), p.dtype), p._local_tensor))
        else:
            plain["params"][n] = p
    if opt is None:
        return shards, plain
    for group in opt.param_groups:
        pnames = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("elastic.TorchState: the optimizer holds a parameter that is not one of the "
                                 "model's; with an FSDP2 model the optimizer must be over model.parameters()")
            n = names[id(p)]
            pnames.append(n)
            for k, v in sorted(opt.state.get(p, {}).items()):
                if _is_dtensor(v):
                    if tuple(v.shape) != tuple(p.shape) or tuple(v.placements) != tuple(p.placements):
                        raise ValueError(
                            f"elastic.TorchState: optimizer state {k!r} of {n!r} is a DTensor of shape "
                            f"{list(v.shape)}, placements {tuple(v.placements)}; elastic re-partitions optimizer "
                            f"state laid out as its parameter (shape {list(p.shape)}, placements "
                            f"{tuple(p.placements)}) only")
                    shards.append((Entry(("optim", n, k), tuple(v.shape), tuple(v.placements), v.dtype),
                                   v._local_tensor))
                else:
                    plain["optim"].setdefault(n, {})[k] = v
        plain["groups"].append({**{k: v for k, v in group.items() if k != "params"}, "params": pnames})
    return shards, plain


def commit(state: Any, old: Any, stride: int = 1) -> tuple[dict[str, Any], list[Any]]:
    """This rank's FSDP2 commit: its local shards packed into one buffer (sent to its buddy,
    ``stride`` ranks on, while the ward's buffer is received) and a copy of the replicated rest;
    returns the commit and the transfers to wait for. ``old``: the commit whose memory may be reused."""
    from . import replicas, values

    if getattr(state, "_fsdp_pending", None) is not None:
        raise ElasticError("elastic: the FSDP2 model was not rebuilt after the recovery; register "
                           "elastic.RebuildFSDP(state, build) with state.register_reset_callbacks")
    if getattr(state.comm, "fault_tolerant", False) and not any(isinstance(fn, RebuildFSDP) for fn in state._callbacks):
        raise ValueError("elastic.TorchState: an FSDP2 model must be rebuilt on the survivors after a "
                         "failure; register elastic.RebuildFSDP(state, build) with "
                         "state.register_reset_callbacks before the first commit")
    shards, plain = _tensors(state)
    entries = [e for e, _ in shards]
    world, me = state.world_size, state.rank
    old = old or {}
    same = old.get("entries") == entries and old.get("world") == world
    offs = old["offs"] if same else _offsets(entries, world, me)
    own = old.get("own")
    if own is None or own.numel() != offs[-1]:
        own = torch.empty(offs[-1], dtype=torch.uint8)
    own[:_HEAD].view(torch.int64)[0] = digest(entries)
    for (e, t), lo in zip(shards, offs):
        _view(own, e, lo, world, me).copy_(t.detach())
    c = {"entries": entries, "world": world, "offs": offs, "own": own, "ward": None}
    works = []
    if world > 1:      # the packed shards travel while the replicated rest is copied
        prev = replicas.ward(me, world, stride)
        need = old["ward"].numel() if same else _offsets(entries, world, prev)[-1]
        ward = old.get("ward")
        c["ward"] = ward if ward is not None and ward.numel() == need else torch.empty(need, dtype=torch.uint8)
        works = [state.comm.irecv(c["ward"], prev, tag=_TAG),
                 state.comm.isend(own, replicas.buddy(me, world, stride), tag=_TAG)]
    c["plain"] = values.tree_copy(plain, old.get("plain"))
    return c, works


def rollback(state: Any, c: dict[str, Any], count: int, new_comm: Any, survivors: Sequence[int],
             stride: int = 1) -> None:
    """Re-partition commit ``c`` (of the old world; the ``count``-th user commit) over ``new_comm``
    (old ranks ``survivors``; -1: a rank that joined, which holds nothing): each rank receives the
    pieces of its new local shards from the owners or buddies of the old ones; they wait in the
    state for ``RebuildFSDP`` to load them into the rebuilt model."""
    from . import replicas

    world = c["world"]
    olds = [s for s in survivors if s >= 0]
    held = replicas.holders(world, olds, stride)
    lost = [s for s, h in enumerate(held) if h is None]
    if lost:
        raise ShardsLostError(
            f"elastic: the FSDP2 shards of old ranks {lost} are lost (each rank and its buddy, {stride} on, "
            f"both failed; survivors: old ranks {olds})", lost)
    if not any(isinstance(fn, RebuildFSDP) for fn in state._callbacks):
        raise ElasticError("elastic: an FSDP2 model must be rebuilt on the survivors: register "
                           "elastic.RebuildFSDP(state, build) with state.register_reset_callbacks")
    entries = c["entries"]
    me = survivors[int(new_comm.rank)]
    mine = {s: (c["own"] if s == me else c["ward"]) for s in range(world) if held[s] == me}
    seen = [digest(entries)] + [int(b[:_HEAD].view(torch.int64)[0]) for b in mine.values()]
    both = torch.tensor([min(seen), -max(seen)], dtype=torch.int64)    # every rank's digest, every held buffer's
    new_comm.all_reduce(both, op=_min())
    if int(both[0]) != -int(both[1]):
        raise ElasticError("elastic: the old ranks' FSDP2 commits do not list the same parameters and optimizer "
                           "state (names, shapes, placements, dtypes); the shards cannot be re-partitioned")
    n, r = int(new_comm.size), int(new_comm.rank)
    offs = _offsets(entries, n, r)
    (packed,) = repartition.exchange(new_comm, plan(entries, world, n, dst=r), plan(entries, world, n, srcs=list(mine)),
                                     {s: [b] for s, b in mine.items()}, [survivors.index(h) for h in held],
                                     [torch.empty(0, dtype=torch.uint8)], offs[-1])
    shards = {e.key: _view(packed, e, offs[i], n, r) for i, e in enumerate(entries)}
    state._fsdp_pending = ({"entries": entries, "shards": shards, "plain": c["plain"],
                                                "count": count})


def _min() -> Any:
    import mpicomm

    return mpicomm.ReduceOp.MIN


class RebuildFSDP:
    """A reset callback: ``build()`` makes the model (``fully_shard`` on a mesh of the current
    world) and its optimizer anew; they get the committed state re-partitioned over the
    survivors (or, when a shard was lost with its replica, the newest checkpoint of the state's
    ``checkpoint_dir``, loaded by ckpt N->M), become ``state.model`` and ``state.optimizer``,
    and are committed."""

    def __init__(self, state: Any, build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]) -> None:
        if not callable(build):
            raise TypeError(f"elastic.RebuildFSDP: expected a callable build() -> (model, optimizer), got {build!r}")
        self.state, self.build = state, build
        self.__qualname__ = f"RebuildFSDP({getattr(build, '__qualname__', repr(build))})"

    @torch.no_grad()
    def __call__(self) -> None:
        state = self.state
        pending = getattr(state, "_fsdp_pending", None)
        if pending is None:
            raise ElasticError("elastic.RebuildFSDP: no recovery of an FSDP2 state is pending")
        err: Exception | None = None
        try:            # a failure on some ranks only must not leave the others alone in the commit
            built = self.build()
            if not (isinstance(built, tuple) and len(built) == 2):
                raise TypeError(f"elastic.RebuildFSDP: build() must return (model, optimizer), got "
                                f"{type(built).__name__}")
            model, opt = built
            if pending.get("disk"):     # checked here, on every rank: the load below is collective
                _check_built(state, model)
            else:
                load(model, opt, pending, state.world_size, state.rank)
        except Exception as e:  # noqa: BLE001 - raised below, once every survivor knows
            err = e
        ok = torch.tensor([int(err is None)])
        state.comm.all_reduce(ok, op=_min())
        if err is not None:
            raise err
        if not int(ok[0]):
            raise ValueError("elastic.RebuildFSDP: the rebuilt model did not take the committed state on another rank")
        before = state.optimizer
        state.model, state.optimizer = model, opt
        if before is not None and opt is not before:
            for value in state._attrs.values():     # an LR scheduler drives the new optimizer now
                retarget(value, before, opt)
        if pending.get("disk"):         # a shard was lost with its replica: the newest checkpoint
            state._resume()             # ckpt.load re-partitions it over the survivors' mesh
            if state.resumed is None:
                raise ElasticError(f"elastic: {state.checkpoint_dir} holds no committed checkpoint")
        object.__setattr__(state, "_fsdp_pending", None)
        state._commit(state.commits if pending.get("disk") else pending["count"])


def shard_dim(placement: Any) -> int:
    """The dimension a ``Shard`` placement splits (the only placement elastic re-partitions)."""
    kind, dim, _ = _dl().placement_kind(placement)
    if kind != "shard":
        raise ValueError(f"elastic: expected a Shard placement, got {placement!r}")
    return int(dim)


def shard(dim: int) -> Any:
    """The ``Shard(dim)`` placement."""
    from torch.distributed.tensor import Shard

    return Shard(int(dim))


def retarget(value: Any, old: Any, new: Any) -> None:
    """Point ``value`` (an LR scheduler, or one that chains schedulers) at optimizer ``new`` where
    it drives ``old``: a scheduler rolled back with the state must step the rebuilt optimizer."""
    if getattr(value, "optimizer", None) is old:
        value.optimizer = new
        new._opt_called = True      # torch's "scheduler stepped before the optimizer" check
    for inner in getattr(value, "_schedulers", None) or ():
        retarget(inner, old, new)


def _check_built(state: Any, model: torch.nn.Module) -> None:
    """The FSDP2 ``model`` build() made is sharded over all the survivors, as a commit needs."""
    if not uses_dtensors(model):
        raise ValueError("elastic.RebuildFSDP: build() made a model without DTensor parameters; expected "
                         "one sharded by fully_shard on the survivors' mesh")
    for name, p in model.named_parameters():
        if _is_dtensor(p):
            _check_mesh(state, name, p)


def _check_new(what: str, dst: Any, e: Entry, want: tuple[int, ...], world: int, rank: int) -> None:
    if not _is_dtensor(dst) or tuple(dst.placements) != e.placements or tuple(dst.shape) != e.shape:
        got = (f"a DTensor of shape {list(dst.shape)}, placements {tuple(dst.placements)}" if _is_dtensor(dst)
               else f"a {type(dst).__name__} of shape {list(dst.shape)}")
        raise ValueError(f"elastic.RebuildFSDP: {what} must be a DTensor of shape {list(e.shape)} with placements "
                         f"{e.placements} (fully_shard on the survivors' mesh), got {got}")
    mesh = dst.device_mesh
    coord = mesh.get_coordinate()
    if mesh.ndim != 1 or mesh.size() != world or coord is None or int(coord[0]) != rank:
        raise ValueError(f"elastic.RebuildFSDP: {what} is on a mesh of {mesh.size()} ranks at coordinate {coord}; "
                         f"expected a 1-D mesh over the {world} survivors (this rank: {rank}), e.g. "
                         "init_device_mesh(dev, (dist.get_world_size(),)) inside build()")
    if tuple(dst._local_tensor.shape) != want:
        raise ValueError(f"elastic.RebuildFSDP: {what} holds a local shard of shape {list(dst._local_tensor.shape)}, "
                         f"expected {list(want)}")


def load(model: torch.nn.Module, opt: torch.optim.Optimizer | None, pending: dict[str, Any],
         world: int, rank: int) -> None:
    """Fill a freshly built FSDP2 ``model`` and its ``opt`` (on a 1-D mesh of ``world`` ranks, this
    one ``rank``) with the re-partitioned local shards and the replicated rest of ``pending``."""
    from torch.distributed.tensor import DTensor

    from . import values

    shards, plain = pending["shards"], pending["plain"]
    params = dict(model.named_parameters())
    had = sorted([e.key[1] for e in pending["entries"] if e.key[0] == "model"] + list(plain["params"]))
    if sorted(params) != had:
        raise ValueError(f"elastic.RebuildFSDP: build() made a model with parameters {sorted(params)}; "
                         f"the committed one had {had}")
    buffers = dict(model.named_buffers())
    if sorted(buffers) != sorted(plain["buffers"]):
        raise ValueError(f"elastic.RebuildFSDP: build() made a model with buffers {sorted(buffers)}; "
                         f"the committed one had {sorted(plain['buffers'])}")
    for e in pending["entries"]:
        p = params[e.key[1]]
        what = f"parameter {e.key[1]!r}" if e.key[0] == "model" else f"the parameter of optimizer state {e.key}"
        _check_new(what, p, e, tuple(shards[e.key].shape), world, rank)
    for e in pending["entries"]:
        if e.key[0] == "model":
            params[e.key[1]]._local_tensor.copy_(shards[e.key])
    for n, v in plain["params"].items():
        params[n].detach().copy_(v)
    for n, v in plain["buffers"].items():
        buffers[n].copy_(v)
    if opt is None:
        return
    names = {id(p): n for n, p in params.items()}
    groups = []
    for group in opt.param_groups:
        if any(id(p) not in names for p in group["params"]):
            raise ValueError("elastic.RebuildFSDP: build()'s optimizer holds a parameter that is not one of "
                             "its model's")
        groups.append([names[id(p)] for p in group["params"]])
    saved = plain["groups"]
    if [g["params"] for g in saved] != groups:
        raise ValueError(f"elastic.RebuildFSDP: build()'s optimizer has parameter groups {groups}; the "
                         f"committed one had {[g['params'] for g in saved]}")
    index = {n: i for i, n in enumerate(n for g in groups for n in g)}
    st: dict[int, dict[str, Any]] = {}
    for n, kv in plain["optim"].items():
        st.setdefault(index[n], {}).update(values.tree_copy(kv))
    for e in pending["entries"]:
        if e.key[0] == "optim":
            p = params[e.key[1]]
            st.setdefault(index[e.key[1]], {})[e.key[2]] = DTensor.from_local(
                shards[e.key].to(p._local_tensor.device), p.device_mesh, p.placements, run_check=False,
                shape=p.shape, stride=p.stride())
    opt.load_state_dict({"state": st, "param_groups": [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]} for g in saved]})
