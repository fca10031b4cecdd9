"""reinit_process_group clears torch's DTensor caches keyed on device meshes: a mesh of the new
default group that equals (by layout) one of the old world must not be handed what torch cached
for the old one (an op's output on the old mesh, whose group is gone)."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from mpicomm import distributed as mdist
from mpicomm.distributed import _mesh_caches
from mpitest import assert_all


@pytest.mark.mpi(min_size=2)
def test_an_equal_mesh_after_reinit_gets_no_plan_of_the_destroyed_group(comm):
    n = comm.size
    x = torch.arange(4.0 * n).reshape(2 * n, 2)
    dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=120))
    err = ""
    try:
        # an old mesh on a group of every rank other than the default one (a "new_group")
        old = DeviceMesh.from_group(dist.new_group(list(range(n))), "cpu")
        d = distribute_tensor(x, old, [Shard(0)])
        before = (d * 2).redistribute(old, [Replicate()]).to_local()
        mdist.reinit_process_group(comm.dup())         # the old groups are gone
        mesh = init_device_mesh("cpu", (n,))
        assert mesh == old                              # torch compares meshes by layout
        d = distribute_tensor(x, mesh, [Shard(0)])
        y = d * 2                                       # the same op and specs as before
        same_mesh = y.device_mesh is mesh
        after = y.redistribute(mesh, [Replicate()]).to_local()
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        err = f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()
    assert_all(err == "", f"after reinit_process_group: {err}")
    assert same_mesh, "the op's output carries the old world's mesh (a cached sharding)"
    torch.testing.assert_close(before, x * 2, rtol=0, atol=0)
    torch.testing.assert_close(after, x * 2, rtol=0, atol=0)


def test_a_torch_without_the_caches_is_fine(monkeypatch):
    monkeypatch.setattr(_mesh_caches, "_clearers", lambda: [("gone", None), ("renamed", 3)])
    assert _mesh_caches.clear_mesh_caches() == []

    def broken() -> None:
        raise TypeError("a cache of another shape")
    monkeypatch.setattr(_mesh_caches, "_clearers", lambda: [("broken", broken), ("fine", lambda: None)])
    assert _mesh_caches.clear_mesh_caches() == ["fine"]


def test_this_torch_has_the_sharding_caches_cleared():
    """torch 2.13 holds both: should they move, the reinit test above shows whether it matters."""
    cleared = _mesh_caches.clear_mesh_caches()
    assert "ShardingPropagator.propagate_op_sharding" in cleared
    assert "torch._C DTensor fast-path sharding cache" in cleared
