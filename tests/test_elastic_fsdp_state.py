"""elastic.TorchState with an FSDP2 model, without a real failure (any MPI, 2+ ranks): commit,
then the survivors of a simulated loss of world rank 0 (a sub-communicator of ranks 1..N-1)
re-partition the committed shards and RebuildFSDP loads them into a model built on their mesh.
Expected: the full parameters and AdamW state gathered by ``DTensor.full_tensor()`` on the old
mesh before, exactly."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import elastic
from elastic_job_lib import LR, local_loss, make_model
from mpitest import assert_all, check_all

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def pg(world):
    dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=120))
    yield
    dist.destroy_process_group()


def _mesh(n: int):
    """A 1-D mesh of the world under a dimension name of this module's own. torch caches DTensor
    redistribution plans (``_redistribute._gen_transform_infos``, ``functools.cache``) keyed by
    specs whose meshes compare by layout and names, not by process group: after other modules'
    FSDP2 tests on a default group destroyed since, an equal mesh here got their plan, and
    ``full_tensor()`` looked for their group ("Could not resolve the process group registered
    under the name 0")."""
    return init_device_mesh("cpu", (n,), mesh_dim_names=("elastic_fsdp_state",))


def sharded(mesh):
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.register_buffer("scale", torch.arange(3.0))
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def full_state(model, opt):
    """Parameters, buffers and optimizer state as full tensors, by name (collective on the mesh)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    out.update({n: b.clone() for n, b in model.named_buffers()})
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"{names[id(p)]}/{k}"] = v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
    return out


def _three_commits(comm, **state_args):
    """An FSDP2 TorchState over the world with RebuildFSDP building on ranks 1..N-1's mesh, after
    three training steps each committed: (state, the models built, full state after each commit)."""
    n, me = comm.size, comm.rank
    model, opt = sharded(_mesh(n))
    sub_group = dist.new_group(list(range(1, n)))      # collective over the world
    state = elastic.TorchState(model=model, optimizer=opt, comm=comm, step=0, **state_args)
    built = []

    def build():
        built.append(sharded(DeviceMesh.from_group(sub_group, "cpu")))
        return built[-1]
    state.register_reset_callbacks([elastic.RebuildFSDP(state, build)])
    wants = []
    for step in range(3):                              # the third commit reuses the first's memory
        opt.zero_grad()
        local_loss(model, step, me, n).backward()
        opt.step()
        state.step += 1
        state.commit()
        wants.append(full_state(model, opt))
    return state, built, wants


def test_a_lost_rank0s_shards_come_back_on_the_survivors_mesh(pg, comm):
    n, me = comm.size, comm.rank
    state, built, wants = _three_commits(comm)
    want = wants[1]                                    # the commit before the newest (a death inside commit())
    sub = comm.split(None if me == 0 else 0)
    got = {}
    if me != 0:                                        # world rank 0 is "lost"
        state._rollback(state.generation - 1, sub, list(range(1, n)), n)
        for fn in state._callbacks:
            fn()
        got = full_state(state.model, state.optimizer)

    def check():
        if me == 0:
            return
        assert state.step == 2 and state.world_size == n - 1 and state.generation == 1 and state.commits == 2
        assert state.model is built[0][0] and state.optimizer is built[0][1]
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        for k in want:
            assert torch.equal(got[k], want[k]), k
        assert not torch.equal(got["0.weight"], wants[2]["0.weight"])
        assert state.replica_bytes() > 0
    check_all(check)


def test_a_2d_mesh_is_refused_by_name(pg, comm):
    mesh = init_device_mesh("cpu", (1, comm.size), mesh_dim_names=("replicate", "shard"))
    model = make_model()
    fully_shard(model, mesh=mesh)                      # HSDP: (Replicate(), Shard(0))
    try:
        elastic.TorchState(model=model, optimizer=None, comm=comm)
        err = ""
    except NotImplementedError as e:
        err = str(e)
    assert_all("2-D mesh" in err and "'0.weight'" in err, err)


def test_a_build_on_the_wrong_mesh_is_refused(pg, comm):
    n, me = comm.size, comm.rank
    model, opt = sharded(_mesh(n))
    sub_group = dist.new_group(list(range(1, n)))
    state = elastic.TorchState(model=model, optimizer=opt, comm=comm)
    # build() keeps the old world's mesh (a common slip): the survivors must hear so
    state.register_reset_callbacks([elastic.RebuildFSDP(state, lambda: sharded(_mesh(n)))])
    state.commit()
    sub = comm.split(None if me == 0 else 0)
    err = ""
    if me != 0:
        state._rollback(state.generation, sub, list(range(1, n)), n)
        try:
            state._callbacks[0]()
        except ValueError as e:
            err = str(e)
    del sub_group
    assert_all(me == 0 or ("expected a 1-D mesh over the" in err and f"{n - 1} survivors" in err), err)


def test_a_build_that_misfits_on_one_survivor_fails_on_every_survivor(pg, comm):
    n, me = comm.size, comm.rank
    model, opt = sharded(_mesh(n))
    sub_group = dist.new_group(list(range(1, n)))
    state = elastic.TorchState(model=model, optimizer=opt, comm=comm)

    def build():
        model, opt = sharded(DeviceMesh.from_group(sub_group, "cpu"))
        if me == n - 1:                                 # another global shape on this survivor only
            model[2].register_parameter("bias", torch.nn.Parameter(torch.zeros(5)))
        return model, opt
    state.register_reset_callbacks([elastic.RebuildFSDP(state, build)])
    state.commit()
    sub = comm.split(None if me == 0 else 0)
    err = ""
    if me != 0:
        state._rollback(state.generation, sub, list(range(1, n)), n)
        try:
            state._callbacks[0]()
        except ValueError as e:
            err = str(e)
    want = "must be a DTensor of shape [3]" if me == n - 1 else "on another rank"
    assert_all(me == 0 or want in err, err)


def test_the_disk_fall_back_loads_the_newest_checkpoint_into_the_rebuilt_model(pg, comm, shared_tmp_path):
    """checkpoint_every=2, three commits: the survivors of a simulated loss of world rank 0 take
    the disk path (as when a shard and its replica are both lost): RebuildFSDP builds the model on
    their mesh and loads the checkpoint of commit 2 (saved over all ranks) into it."""
    n, me = comm.size, comm.rank
    state, built, wants = _three_commits(comm, checkpoint_dir=str(shared_tmp_path / "ck"), checkpoint_every=2)
    state.wait_checkpoint()
    want = wants[1]                                    # the checkpoint of commit 2
    sub = comm.split(None if me == 0 else 0)
    got = {}
    if me != 0:                                        # world rank 0 is "lost"
        state._restart_from_disk(sub)
        for fn in state._callbacks:
            fn()
        got = full_state(state.model, state.optimizer)

    def check():
        if me == 0:
            return
        assert state.resumed["commits"] == 2 and state.resumed["saved_world_size"] == n, state.resumed
        assert state.resumed["path"].endswith("step2"), state.resumed
        assert state.step == 2 and state.commits == 2 and state.world_size == n - 1 and state.generation == 1
        assert state.model is built[0][0] and state.optimizer is built[0][1]
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        for k in want:
            assert torch.equal(got[k], want[k]), k
        assert not torch.equal(got["0.weight"], wants[2]["0.weight"])
    check_all(check)
