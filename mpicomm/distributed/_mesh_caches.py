"""torch's DTensor caches keyed on device meshes, cleared when the default group is re-created.

A ``DeviceMesh`` compares equal to another of the same layout, dimension names and thread,
whatever its process group. After ``reinit_process_group`` a mesh built on the survivors can
equal one of the old world (same size, e.g. a mesh of an old ``new_group`` over every rank),
and torch's caches keyed on meshes hand it what they computed for the old one: above all the
sharding propagation (an op's output then carries the old mesh, and its next redistribution
asks for the destroyed group: "Could not resolve the process group registered under the name
..."). Each cache is cleared only where this torch has it."""
from __future__ import annotations

import logging

log = logging.getLogger("mpicomm")


def _clearers() -> list[tuple[str, object]]:
    """(name, what clears it) for every mesh-keyed cache this torch has."""
    import torch

    found: list[tuple[str, object]] = []
    try:
        from torch.distributed.tensor import _redistribute as redistribute
    except ImportError:  # pragma: no cover - a torch without DTensor
        return found
    infos = getattr(redistribute, "_gen_transform_infos", None)
    found.append(("_redistribute._gen_transform_infos", getattr(infos, "cache_clear", None)))
    found.append(("_redistribute._planner_cache", getattr(redistribute, "clear_redistribute_planner_cache", None)))
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._collective_utils import MeshTopoInfo
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # pragma: no cover
        return found
    prop = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    found.append(("ShardingPropagator.propagate_op_sharding",
                  getattr(getattr(prop, "propagate_op_sharding", None), "cache_clear", None)))
    found.append(("ShardingPropagator._propagate_tensor_meta_cached",
                  getattr(getattr(ShardingPropagator, "_propagate_tensor_meta_cached", None), "cache_clear", None)))
    found.append(("torch._C DTensor fast-path sharding cache",
                  getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)))
    found.append(("MeshTopoInfo.build_from_mesh",
                  getattr(getattr(MeshTopoInfo, "build_from_mesh", None), "cache_clear", None)))
    return found


def clear_mesh_caches() -> list[str]:
    """Clear torch's DTensor caches keyed on device meshes; returns the names of those cleared."""
    cleared = []
    for name, clear in _clearers():
        if not callable(clear):
            continue
        try:
            clear()
        except Exception as e:  # noqa: BLE001 - a torch whose cache changed shape: the others still go
            log.debug("mpicomm: clearing torch's %s failed: %s", name, e)
            continue
        cleared.append(name)
    return cleared
