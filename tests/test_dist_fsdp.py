"""DeviceMesh, DTensor, FSDP2 and subgroups on the "mpicomm" backend against gloo in the same run."""
from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import mpicomm  # noqa: F401 - registers the backend
from mpitest import assert_all, assert_close_all

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.fixture
def meshes(world):
    """(mesh on mpicomm, mesh on gloo) over all ranks; the default group is mpicomm."""
    dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")
    yield init_device_mesh("cpu", (world.size,)), DeviceMesh.from_group(gloo, "cpu")
    dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _train_fsdp(mesh, rank, steps=4):
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(50 + rank)
    for _ in range(steps):
        x = torch.randn(6, 12, generator=gen)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def test_mesh_groups_are_mpicomm(meshes):
    ours, _ = meshes
    group = ours.get_group()
    assert_all(group.name() == "mpicomm" or dist.get_backend(group) == "mpicomm",
               dist.get_backend(group))
    assert_all(bool(ours.get_group().group_name), "the mesh's group has a name")


def test_fsdp2_matches_gloo(meshes, world):
    ours, gloo = meshes
    ref = _train_fsdp(gloo, world.rank)
    got = _train_fsdp(ours, world.rank)
    assert_close_all(got, ref.numpy(), atol=1e-6, what="FSDP2 on mpicomm vs gloo")
    assert_close_all(got, world.bcast(got.numpy(), root=0), what="parameters agree across ranks")


def test_dtensor_ops_match_gloo(meshes, world):
    ours, gloo = meshes
    n = world.size
    torch.manual_seed(1)
    a = torch.randn(4 * n, 6)
    b = torch.randn(6, 2 * n)

    def run(mesh):
        da = distribute_tensor(a, mesh, [Shard(0)])
        db = distribute_tensor(b, mesh, [Shard(1)])
        prod = (da @ db.redistribute(mesh, [Replicate()])).redistribute(mesh, [Shard(1)])
        total = da.sum()
        return torch.cat([prod.full_tensor().reshape(-1), total.full_tensor().reshape(-1),
                          da.redistribute(mesh, [Replicate()]).to_local().reshape(-1)])

    ref = run(gloo)
    got = run(ours)
    assert_close_all(got, ref.numpy(), atol=1e-6, what="DTensor on mpicomm vs gloo")
    expect = np.concatenate([(a @ b).numpy().reshape(-1), [a.sum().item()], a.numpy().reshape(-1)])
    assert_close_all(got, expect, atol=1e-4, what="DTensor vs plain torch")


def test_2d_mesh_and_subgroups(meshes, world):
    n = world.size
    if n % 2:
        pytest.skip("needs an even number of ranks")
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
    x = torch.arange(float(2 * n * 3)).reshape(2 * n, 3)
    d = distribute_tensor(x, mesh, [Shard(0), Shard(0)])
    assert_close_all(d.full_tensor(), x.numpy(), what="2-D mesh Shard/Shard")
    tp = mesh["tp"].get_group()
    t = torch.tensor([float(world.rank)])
    dist.all_reduce(t, group=tp)
    tp_ranks = dist.get_process_group_ranks(tp)
    assert_close_all(t, np.array([float(sum(tp_ranks))]), what="all_reduce on the tp subgroup")
    assert_all(dist.get_backend(tp) == "mpicomm", dist.get_backend(tp))

    sub, subs = dist.new_subgroups(group_size=2 if n > 1 else 1)
    u = torch.tensor([float(world.rank + 1)])
    dist.all_reduce(u, group=sub)
    mine = dist.get_process_group_ranks(sub)
    assert_close_all(u, np.array([float(sum(r + 1 for r in mine))]), what="new_subgroups")
    odd = dist.new_group([r for r in range(n) if r % 2 == 1])
    if world.rank % 2 == 1:
        v = torch.tensor([1.0])
        dist.all_reduce(v, group=odd)
        ok = v.item() == n // 2
    else:
        ok = odd == dist.GroupMember.NON_GROUP_MEMBER
    assert_all(ok, "new_group of the odd ranks")


def test_split_group_needs_an_accelerator_backend_as_on_gloo(meshes):
    """torch 2.13 splits only accelerator backends (NCCL/XCCL): same refusal as gloo's."""
    if torch.accelerator.is_available():
        pytest.skip("accelerator build: split_group's CPU refusal does not apply")

    def message(group):
        try:
            dist.split_group(group, [[r] for r in range(dist.get_world_size())])
        except (RuntimeError, ValueError) as exc:
            return type(exc).__name__
        return "no error"

    _, gloo = meshes
    assert_all(message(None) == message(gloo.get_group()) != "no error",
               f"mpicomm: {message(None)}, gloo: {message(gloo.get_group())}")
