"""DTensors in a checkpoint, touched through metadata only: ``_local_tensor``, ``placements``,
``device_mesh`` (a DTensor operation may issue a process-group collective, which must never run
inside an MPI-IO round). What a rank writes and reads of a DTensor: the runs of its local shard in
the full row-major tensor (``dtensor_layout``)."""
from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from . import dtensor_layout as dl
from .errors import IncompatibleStateError


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a torch DTensor (plain tensors answer without importing torch.distributed)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not isinstance(t, torch.Tensor):
        return False
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


@functools.cache
def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a plain tensor sharing its storage)."""
    return t._local_tensor.detach()


def sharding(t: torch.Tensor, what: str) -> dl.Sharding:
    """The layout of DTensor ``t`` (called ``what`` in errors); refuses ``Partial`` and other
    placements that are not Shard / Replicate, and a local tensor of another shape than the
    placements give this rank."""
    mesh = t.device_mesh
    placements = tuple(t.placements)
    got = tuple(t._local_tensor.shape)
    key = (id(mesh), placements, tuple(t.shape), got)
    hit = _SHARDINGS.get(key)
    if hit is not None and hit[0] is mesh:  # a layout already built and checked on this rank
        return hit[1]
    for p in placements:
        kind = dl.placement_kind(p)[0]
        if kind not in ("shard", "strided", "replicate"):
            raise IncompatibleStateError(
                f"{what}: a DTensor with placement {p} ({kind}) cannot be saved or loaded: its local tensors are "
                "not parts of the full tensor; redistribute it to Shard or Replicate placements first "
                "(e.g. dtensor.redistribute(mesh, [Replicate()]))")
    coord = mesh.get_coordinate()
    mesh_shape, mesh_ranks = _mesh_ranks(mesh)
    s = dl.Sharding(tuple(int(x) for x in t.shape), mesh_shape, mesh_ranks, placements,
                    None if coord is None else tuple(int(c) for c in coord))
    want = dl.local_shape(s.mine()) if coord is not None else None
    if want is not None and want != got:
        raise IncompatibleStateError(
            f"{what}: DTensor of global shape {list(s.shape)} on {s.describe()} at mesh coordinate {list(coord)} "
            f"should hold a local shard of shape {list(want)}, it holds {list(got)}: the global shape does not "
            "match the local shards (do the ranks agree on it?)")
    if len(_SHARDINGS) > 4096:
        _SHARDINGS.clear()
    _SHARDINGS[key] = (mesh, s)
    return s


# layouts by (mesh id, placements, global shape, local shape), the mesh kept to tell a reused id:
# a model's tensors of one shape on one mesh share one Sharding (and its runs, ``io_plan``)
_SHARDINGS: dict[tuple, tuple[Any, dl.Sharding]] = {}
_MESHES: dict[int, tuple[Any, tuple[int, ...], tuple[int, ...]]] = {}


def _mesh_ranks(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of ``mesh`` and its global ranks in coordinate order, read once per mesh object
    (torch builds ``mesh.mesh`` anew on each access): a model's tensors on one mesh cost
    O(mesh size) once, not once per tensor."""
    hit = _MESHES.get(id(mesh))
    if hit is not None and hit[0] is mesh:
        return hit[1], hit[2]
    if len(_MESHES) > 64:
        _MESHES.clear()
    grid = mesh.mesh
    shape, ranks = tuple(int(x) for x in grid.shape), tuple(int(r) for r in grid.reshape(-1).tolist())
    _MESHES[id(mesh)] = (mesh, shape, ranks)
    return shape, ranks


def like(template: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new DTensor laid out as DTensor ``template`` (same mesh, placements, global shape), of
    ``dtype``, its local shard uninitialised. No collective."""
    from torch.distributed.tensor import DTensor

    loc = torch.empty(template._local_tensor.shape, dtype=dtype, device=template._local_tensor.device)
    spec = getattr(template, "_spec", None)
    if spec is None or spec.tensor_meta is None:  # pragma: no cover - a torch without DTensor specs
        return DTensor.from_local(loc, template.device_mesh, template.placements, run_check=False,
                                  shape=template.shape, stride=template.stride())
    # the template's spec with this dtype, as torch's own backward copies one (``from_local`` builds
    # and checks a new spec through an autograd function: 5x the time, paid per optimizer state)
    spec = copy.copy(spec)
    if spec.tensor_meta.dtype != dtype:
        spec.tensor_meta = spec.tensor_meta._replace(dtype=dtype)
    # DTensor's __init__ does nothing but pass through torch's tracing wrappers (dynamo, export),
    # which cost as much again as the rest: ckpt.load is not traced
    return DTensor.__new__(DTensor, loc, spec, requires_grad=False)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` in place: local shard to local shard when both are DTensors of one
    layout (no collective), plain ``copy_`` otherwise."""
    with torch.no_grad():
        if is_dtensor(dst) and is_dtensor(src):
            if dst._local_tensor.shape != src._local_tensor.shape or tuple(dst.placements) != tuple(src.placements):
                raise IncompatibleStateError("load: a DTensor loads only into a DTensor of the same placements")
            dst._local_tensor.copy_(src._local_tensor)
        elif is_dtensor(dst) or is_dtensor(src):
            raise IncompatibleStateError("load: a DTensor loads only into a DTensor of the same placements")
        else:
            dst.copy_(src)


def pg_rank() -> int | None:
    """This process's rank in torch.distributed's default group (None when there is none)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def check_meshes(sharded: list[tuple[str, dl.Sharding]], pg_ranks: list[int | None], op: str) -> None:
    """Every rank of every DTensor's mesh must be a rank of the communicator (``pg_ranks``: the
    process-group rank of each of its ranks): else ranks outside would hold shards that nobody
    saves or loads."""
    held = {r for r in pg_ranks if r is not None}
    seen: set[int] = set()  # meshes checked (tensors on one mesh share its ranks tuple)
    for what, s in sharded:
        if id(s.mesh_ranks) in seen:
            continue
        seen.add(id(s.mesh_ranks))
        outside = sorted(set(s.mesh_ranks) - held)
        if outside:
            raise IncompatibleStateError(
                f"{op}: {what} is a DTensor on a device mesh over process-group ranks {sorted(s.mesh_ranks)}; "
                f"rank(s) {outside[:16]} are outside the {op}'s communicator, whose {len(pg_ranks)} rank(s) are "
                f"process-group ranks {list(pg_ranks)[:16]}: pass comm= a communicator that holds every rank of "
                "every DTensor's mesh")


def check_tables(tables: list[list[tuple]], op: str) -> None:
    """Raise naming the first tensor whose name, shape, dtype or DTensor layout differs between
    ranks (``tables``: every rank's ``SavePlan.table()``, in rank order)."""
    first = tables[0]
    for r, t in enumerate(tables):
        if len(t) != len(first):
            raise IncompatibleStateError(f"{op}: the ranks hold different state: rank 0 has {len(first)} tensors, "
                                         f"rank {r} has {len(t)}")
    for i, row in enumerate(first):
        rows = [t[i] for t in tables]
        if any(x != row for x in rows):
            name, kind, key = row[0], row[1], row[2]
            desc = "; ".join(f"rank {r}: {x[0]!r} shape {x[3]} {x[4]}" + (f" {_layout(x[5])}" if x[5] else "")
                             for r, x in enumerate(rows[:8]))
            raise IncompatibleStateError(
                f"{op}: the ranks disagree on the global shape, dtype or placement of {kind} {name!r}"
                + (f" {key!r}" if key else "") + f": {desc}; every rank must hold the same tensors")
    raise IncompatibleStateError(f"{op}: the ranks disagree on the saved tensors")


def _layout(key: tuple) -> str:
    _shape, mesh_shape, _ranks, placements = key
    return f"mesh {list(mesh_shape)} ({', '.join(placements)})"
