"""FSDP2 (``fully_shard``) models and their AdamW state through ckpt: saved at N ranks, loaded at M
(FSDP2 at another size, other mesh shapes, a plain module at 1 rank, a ZeroOptimizer model).

Expected values are the full tensors gathered with ``DTensor.full_tensor()`` outside the
checkpoint code (on the saving job's process group) and read back with ``safetensors``; sub-jobs
of sizes 1..4 run on the first ranks of the pytest world (their own torch group, device mesh and
mpicomm communicator)."""
from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import ckpt
import mpicomm  # noqa: F401 - registers the backend
from mpitest import assert_all, check_all
from zero import ZeroOptimizer

pytestmark = pytest.mark.mpi(min_size=1)
MOVES = [(1, 1), (2, 1), (1, 2), (2, 2), (2, 3), (3, 3), (4, 2), (4, 4)]


@pytest.fixture(scope="module")
def pg(world):
    dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=120))
    yield
    dist.destroy_process_group()


class Job:
    """The first ``n`` ranks of the world: an mpicomm communicator, a torch group and a 1-D mesh
    on them (None elsewhere). Collective over the world."""

    def __init__(self, comm, n: int) -> None:
        self.n, self.member = n, comm.rank < n
        group = dist.new_group(list(range(n))) if n < comm.size else dist.group.WORLD
        self.comm = comm.split(0 if self.member else None) if n < comm.size else comm
        self.mesh = DeviceMesh.from_group(group, "cpu") if self.member else None

    def close(self, comm) -> None:
        if self.comm is not None and self.comm is not comm:
            self.comm.free()


def make_model(mesh=None, dtype=torch.float32, mp=None, seed=0):
    """Odd sizes (7 and 3 rows: uneven shards at 2, 3 and 4 ranks), a buffer; FSDP2 per layer on ``mesh``."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(dtype)
    m.register_buffer("scale", torch.arange(3.0))
    if mesh is not None:
        kw = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
        for layer in (m[0], m[2]):
            fully_shard(layer, **kw)
        fully_shard(m, **kw)
    return m


def train(model, opt, steps, rank, seed=0):
    for s in range(steps):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1000 * seed + 10 * s + rank))
        dtype = next(model.parameters()).dtype
        (model(x.to(dtype)).float() * model.scale).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def full(t):
    """The full tensor, gathered by DTensor itself (a collective on its mesh)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def reference(model, opt):
    """Model state and optimizer state as full tensors (name -> tensor; (name, key) -> tensor)."""
    ms = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    st = {}
    for p, s in opt.state.items():
        for k, v in s.items():
            st[(names[id(p)], k)] = full(v).detach().clone()
    return ms, st


def assert_matches(model, opt, ref, what):
    ms, st = reference(model, opt)
    want_ms, want_st = ref

    def check():
        assert ms.keys() == want_ms.keys()
        for k in ms:
            assert ms[k].dtype == want_ms[k].dtype and torch.equal(ms[k], want_ms[k]), f"{what}: {k}"
        if opt is not None:
            assert st.keys() == want_st.keys(), f"{what}: {sorted(st)} != {sorted(want_st)}"
            for k in st:
                assert torch.equal(st[k].to(want_st[k].dtype), want_st[k]), f"{what}: state {k}"
    check_all(check)


def save_job(comm, world, path, n, dtype=torch.float32, mp=None):
    """Train FSDP2 on the first ``n`` ranks and save; return the reference on every world rank."""
    job = Job(comm, n)
    ref = None
    if job.member:
        model = make_model(job.mesh, dtype, mp)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
        train(model, opt, 3, job.comm.rank)
        ckpt.save(path, model=model, optimizer=opt, step=3, comm=job.comm)
        ref = reference(model, opt)
    job.close(comm)
    return world.bcast(ref, root=0)


@pytest.mark.parametrize("saved,loaded", MOVES, ids=[f"{a}to{b}" for a, b in MOVES])
def test_fsdp2_saved_at_n_loads_at_m(pg, comm, world, shared_tmp_path, saved, loaded):
    if max(saved, loaded) > comm.size:
        pytest.skip(f"needs {max(saved, loaded)} ranks")
    path = str(shared_tmp_path / "ck")
    ref = save_job(comm, world, path, saved)
    job = Job(comm, loaded)
    if job.member:
        model = make_model(job.mesh, seed=5)
        opt = torch.optim.AdamW(model.parameters(), lr=0.5)
        info = ckpt.load(path, model=model, optimizer=opt, comm=job.comm)
        assert info.world_size == saved and info.step == 3
        ms, st = reference(model, opt)  # full_tensor(): collective on the loading job's mesh
        assert ms.keys() == ref[0].keys() and st.keys() == ref[1].keys()
        assert all(torch.equal(ms[k], ref[0][k]) for k in ref[0]), f"{saved}->{loaded}: model differs"
        assert all(torch.equal(st[k], ref[1][k]) for k in ref[1]), f"{saved}->{loaded}: optimizer state differs"
        assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.8, 0.95)
        train(model, opt, 1, job.comm.rank)  # trains on
    job.close(comm)
    world.Barrier()


def test_optimizer_state_dict_after_load_equals_saved(pg, comm, world, shared_tmp_path):
    """Same size: ``opt.state_dict()`` after a load equals the one saved, shard for shard."""
    path = str(shared_tmp_path / "ck")
    mesh = init_device_mesh("cpu", (comm.size,))
    model = make_model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, opt, 2, comm.rank)
    ckpt.save(path, model=model, optimizer=opt, comm=comm)
    model2 = make_model(mesh, seed=3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.3)
    ckpt.load(path, model=model2, optimizer=opt2, comm=comm)
    a, b = opt.state_dict(), opt2.state_dict()

    def check():
        assert a["param_groups"] == b["param_groups"]
        assert a["state"].keys() == b["state"].keys()
        for i in a["state"]:
            assert a["state"][i].keys() == b["state"][i].keys()
            for k, v in a["state"][i].items():
                w = b["state"][i][k]
                assert type(v) is type(w), (i, k, type(v), type(w))
                if hasattr(v, "placements"):
                    assert v.placements == w.placements and v.shape == w.shape
                    v, w = v._local_tensor, w._local_tensor
                assert v.dtype == w.dtype and torch.equal(v, w), (i, k)
    check_all(check)


@pytest.mark.parametrize("kind", ["bf16", "mixed"])
def test_bf16_parameters_and_fp32_state(pg, comm, world, shared_tmp_path, kind):
    """bf16 parameters (and their bf16 AdamW state), or FSDP2 mixed precision (fp32 sharded
    parameters and state, bf16 compute): saved and loaded at another size in their own dtypes."""
    path = str(shared_tmp_path / "ck")
    dtype, mp = (torch.bfloat16, None) if kind == "bf16" else \
        (torch.float32, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    ref = save_job(comm, world, path, comm.size, dtype, mp)
    job = Job(comm, max(1, comm.size - 1))
    if job.member:
        model = make_model(job.mesh, dtype, mp, seed=9)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
        ckpt.load(path, model=model, optimizer=opt, comm=job.comm)
        ms, st = reference(model, opt)
        assert all(ms[k].dtype == ref[0][k].dtype and torch.equal(ms[k], ref[0][k]) for k in ref[0])
        assert all(st[k].dtype == ref[1][k].dtype and torch.equal(st[k], ref[1][k]) for k in ref[1])
        if kind == "mixed":
            assert {v.dtype for k, v in st.items() if k[1] != "step"} == {torch.float32}
    job.close(comm)
    world.Barrier()


def test_loads_into_a_plain_module_at_one_rank_and_reads_as_safetensors(pg, comm, world, shared_tmp_path):
    path = str(shared_tmp_path / "ck")
    ref = save_job(comm, world, path, comm.size)
    solo = comm.split(0 if comm.rank == 0 else None)
    if solo is not None:
        from safetensors.torch import load_file

        model = make_model(None, seed=4)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        ckpt.load(path, model=model, optimizer=opt, comm=solo)
        ms, st = reference(model, opt)
        assert all(torch.equal(ms[k], ref[0][k]) for k in ref[0])
        assert all(torch.equal(st[k], ref[1][k]) for k in ref[1])
        data = load_file(os.path.join(path, "data.bin"))
        for k, v in ref[0].items():
            assert torch.equal(data[k], v), k
        for (n, k), v in ref[1].items():
            if k != "step":
                assert torch.equal(data[f"optimizer/state/{n}/{k}"], v), (n, k)
        solo.free()
    world.Barrier()


def test_loads_into_a_zero_optimizer(pg, comm, world, shared_tmp_path):
    """An FSDP2 checkpoint loads into a plain model with a ZeroOptimizer (each rank reads its
    shard of the fp32 state); saved again from there, it holds the same tensors."""
    path, again = str(shared_tmp_path / "ck"), str(shared_tmp_path / "again")
    ref = save_job(comm, world, path, comm.size)
    model = make_model(None, seed=4)
    zero = ZeroOptimizer(torch.optim.AdamW, model.parameters(), stage=1, comm=comm, lr=0.01, betas=(0.8, 0.95))
    ckpt.load(path, model=model, optimizer=zero, comm=comm)
    ckpt.save(again, model=model, optimizer=zero, comm=comm)
    ok, msg = True, ""
    if comm.rank == 0:
        from safetensors.torch import load_file

        data = load_file(os.path.join(again, "data.bin"))
        for k, v in ref[0].items():
            ok, msg = (ok and torch.equal(data[k], v)), msg or k
        for (n, k), v in ref[1].items():
            if k != "step":
                ok, msg = (ok and torch.equal(data[f"optimizer/state/{n}/{k}"], v)), msg or f"{n} {k}"
    assert_all(ok, f"differs: {msg}")


def test_two_d_meshes(pg, comm, world, shared_tmp_path):
    """HSDP (Replicate, Shard(0)) and FSDP x TP (_StridedShard, Shard(1), Replicate) on a 2x2
    mesh save; each loads into the other layouts and into 1-D FSDP2 at 3 ranks."""
    if comm.size != 4:
        pytest.skip("needs 4 ranks")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def build(kind, seed):
        torch.manual_seed(seed)  # even TP sizes: torch's TP needs them
        m = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        if kind == "tp":
            parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(m, mesh=mesh["dp"])
        elif kind == "hsdp":
            fully_shard(m, mesh=mesh)
        return m

    three = Job(comm, 3)
    for kind in ("tp", "hsdp"):
        path = str(shared_tmp_path / kind)
        m = build(kind, 0)
        opt = torch.optim.AdamW(m.parameters(), lr=0.01)
        for s in range(2):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(s + comm.rank // 2))
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        ckpt.save(path, model=m, optimizer=opt, comm=comm)
        ref = reference(m, opt)
        for other in ("tp", "hsdp"):
            m2 = build(other, 1)
            opt2 = torch.optim.AdamW(m2.parameters(), lr=0.01)
            ckpt.load(path, model=m2, optimizer=opt2, comm=comm)
            assert_matches(m2, opt2, ref, f"{kind} -> {other}")
        if three.member:
            torch.manual_seed(2)
            m3 = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
            fully_shard(m3, mesh=three.mesh)
            opt3 = torch.optim.AdamW(m3.parameters(), lr=0.01)
            ckpt.load(path, model=m3, optimizer=opt3, comm=three.comm)
            ms, st = reference(m3, opt3)
            assert all(torch.equal(ms[k], ref[0][k]) for k in ref[0]), kind
            assert all(torch.equal(st[k], ref[1][k]) for k in ref[1]), kind
        world.Barrier()
    three.close(comm)


@pytest.mark.parametrize("snapshot", ["now", "background"])
def test_async_save_state_items_and_scheduler(pg, comm, world, shared_tmp_path, snapshot):
    """async_save of an FSDP2 model snapshots the shards (training on does not change what is
    saved; with snapshot='background' the step waits for the copy); RNG, PerRank and an LR
    scheduler round-trip beside it."""
    mesh = init_device_mesh("cpu", (comm.size,))
    model = make_model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, 2, comm.rank)
    sched.step()
    counter = {"seen": 10 + comm.rank}

    class Counter:
        def state_dict(self):
            return dict(counter)

        def load_state_dict(self, sd):
            counter.update(sd)

    torch.manual_seed(100 + comm.rank)
    rng_state = torch.get_rng_state()
    ref = reference(model, opt)
    handle = ckpt.save(str(shared_tmp_path / "a"), model=model, optimizer=opt, comm=comm, async_save=True,
                       state={"sched": sched, "rng": ckpt.RNG(), "data": ckpt.PerRank(Counter())},
                       snapshot=snapshot)
    train(model, opt, 1, comm.rank)  # the save writes the snapshot, not this
    handle.wait()
    counter["seen"] = -1
    torch.manual_seed(7)
    model2 = make_model(mesh, seed=2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.01)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    ckpt.load(str(shared_tmp_path / "a"), model=model2, optimizer=opt2, comm=comm,
              state={"sched": sched2, "rng": ckpt.RNG(), "data": ckpt.PerRank(Counter())})
    assert_matches(model2, opt2, ref, "async")
    assert_all(torch.equal(torch.get_rng_state(), rng_state), "RNG state restored")
    assert_all(counter["seen"] == 10 + comm.rank and sched2.last_epoch == 1, f"{counter} {sched2.last_epoch}")
    assert_all(opt2.param_groups[0]["lr"] == 0.005, f"lr {opt2.param_groups[0]['lr']}")


def test_dtensor_state_item_loads_into_another_layout(pg, comm, world, shared_tmp_path):
    """A DTensor in a ``state=`` item (Shard(1), uneven) loads into a DTensor of another
    placement (Shard(0)) and into a plain tensor at 1 rank."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (comm.size,))
    g = torch.Generator().manual_seed(3)
    value = torch.randn(6, 2 * comm.size + 1, generator=g)
    saved = {"ema": distribute_tensor(value, mesh, [Shard(1)]), "n": 3}
    ckpt.save(str(shared_tmp_path / "s"), model=torch.nn.Linear(1, 1), comm=comm, state={"item": saved})
    target = {"ema": distribute_tensor(torch.zeros_like(value), mesh, [Shard(0)]), "n": 0}
    res = ckpt.load(str(shared_tmp_path / "s"), model=torch.nn.Linear(1, 1), comm=comm, state={"item": target})
    got = target["ema"].full_tensor()
    assert_all(torch.equal(got, value) and res.state["item"]["n"] == 3, "DTensor item")
    solo = comm.split(0 if comm.rank == 0 else None)
    if solo is not None:
        plain = {"ema": torch.zeros_like(value), "n": 0}
        ckpt.load(str(shared_tmp_path / "s"), model=torch.nn.Linear(1, 1), comm=solo, state={"item": plain})
        assert torch.equal(plain["ema"], value)
        solo.free()
    world.Barrier()
