"""Training state on CUDA through mpicomm: DDP over the mpicomm process group, ZeroOptimizer,
FSDP2 and ckpt (sync and async saves, loads into CUDA and CPU models, N->M from FSDP2,
``ckpt.RNG``'s CUDA generators).

References are computed without the code under test: every rank's inputs are known to every
rank (seeded by rank), so the global-batch gradient and plain ``torch.optim.Adam`` steps are
recomputed in one process on a plain module; saved values are copied to the host before the
save. Skipped without CUDA; ranks share GPUs round-robin. Run with ./scripts/gpu_check.sh.
"""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import ckpt
import mpicomm  # noqa: F401 - registers the backend
from mpitest import check_all

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)")]

STEPS, LR = 3, 1e-2


@pytest.fixture(scope="module")
def group(world, device):
    """An mpicomm process group over the world (the default group unless one exists already)."""
    if dist.is_initialized():
        yield dist.new_group(backend="mpicomm")
        return
    dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=120))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def make_model(seed: int = 0) -> torch.nn.Module:
    """Odd sizes (uneven shards at 2-4 ranks) and a buffer; on the host, fp32."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    m.register_buffer("scale", torch.arange(1.0, 4.0))
    return m


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank))


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) * model.scale).pow(2).mean()


def reference_adam(world_size: int, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Plain Adam on the host over the global batch (the mean of every rank's loss)."""
    ref = make_model()
    opt = torch.optim.Adam(ref.parameters(), lr=LR)
    for s in range(steps):
        opt.zero_grad()
        (sum(loss_of(ref, batch(r, s)) for r in range(world_size)) / world_size).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


def assert_state_close(model: torch.nn.Module, expected: dict[str, torch.Tensor], rtol=1e-5, atol=1e-6) -> None:
    got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        torch.testing.assert_close(got[k].detach().cpu(), v, rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def test_ddp_on_cuda_trains_as_adam_on_the_global_batch(world, device, group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model().to(device)
    if world.rank != 0:                       # DDP must broadcast rank 0's weights and buffer
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                t.add_(1.0)
    ddp = DDP(model, process_group=group)
    opt = torch.optim.Adam(ddp.parameters(), lr=LR)
    for s in range(STEPS):
        opt.zero_grad()
        ((ddp(batch(world.rank, s).to(device)) * model.scale).pow(2).mean()).backward()
        opt.step()

    def check():
        assert all(p.device == device for p in model.parameters()), "a parameter left the GPU"
        assert_state_close(model, reference_adam(world.size))
    check_all(check)


def test_zero_optimizer_on_cuda_trains_as_adam(world, comm, device):
    from zero import ZeroOptimizer

    expected = reference_adam(world.size)
    for stage in (1, 2):
        model = make_model().to(device)
        opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=stage, comm=comm, lr=LR)
        for s in range(STEPS):
            opt.zero_grad()
            loss_of(model, batch(world.rank, s).to(device)).backward()
            opt.step()

        def check():
            assert all(g.master.device == device for g in opt.groups), "the fp32 masters left the GPU"
            assert_state_close(model, expected)
        check_all(check)
        opt.close()


def test_fsdp2_on_cuda_trains_saves_and_loads_on_one_host_rank(world, comm, device, group, shared_tmp_path):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    model = make_model().to(device)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for s in range(STEPS):
        opt.zero_grad()
        loss_of(model, batch(world.rank, s).to(device)).backward()
        opt.step()
    expected = reference_adam(world.size)
    check_all(lambda: assert_state_close(model, expected))
    path = shared_tmp_path / "fsdp2"
    ckpt.save(path, model=model, optimizer=opt, step=STEPS, comm=comm)
    sub = comm.split(0 if comm.rank == 0 else None)    # N -> 1, into a plain module on the host

    def load_on_rank_0():
        if sub is None:
            return
        plain = make_model(seed=1)
        popt = torch.optim.Adam(plain.parameters(), lr=LR)
        info = ckpt.load(path, model=plain, optimizer=popt, comm=sub)
        assert info.step == STEPS
        assert_state_close(plain, expected)
        # one more step from the loaded Adam state equals one more reference step
        popt.zero_grad()
        (sum(loss_of(plain, batch(r, STEPS)) for r in range(world.size)) / world.size).backward()
        popt.step()
        assert_state_close(plain, reference_adam(world.size, STEPS + 1))
    check_all(load_on_rank_0)
    if sub is not None:
        sub.free()


def with_bf16_gain(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with a bf16 parameter beside its fp32 ones (used by :func:`gained_loss`)."""
    model.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3).to(torch.bfloat16))
    return model


def gained_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) * model.scale * model.gain.float()).pow(2).mean()


@pytest.mark.parametrize("async_save", [False, True])
def test_ckpt_of_a_cuda_model_loads_on_cuda_and_on_the_host(comm, device, shared_tmp_path, async_save):
    model = with_bf16_gain(make_model()).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    gained_loss(model, batch(0, 0).to(device)).backward()
    opt.step()
    torch.cuda.manual_seed(1234)
    saved = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    moments = {(n, k): torch.as_tensor(v).detach().cpu().clone() for n, p in model.named_parameters()
               for k, v in opt.state[p].items()}
    assert saved["gain"].dtype == torch.bfloat16 and len(moments) == 3 * len(saved) - 3
    handle = ckpt.save(shared_tmp_path / "plain", model=model, optimizer=opt, step=7, comm=comm,
                       state={"rng": ckpt.RNG()}, async_save=async_save)
    draws = torch.randn(5, device=device).cpu()     # what the restored CUDA generator must draw
    if async_save:
        with torch.no_grad():                        # changes after the save returned are not saved
            for p in model.parameters():
                p.add_(1.0)
        handle.wait()
    for target in (device, torch.device("cpu")):
        fresh = with_bf16_gain(make_model(seed=2)).to(target)
        fopt = torch.optim.Adam(fresh.parameters(), lr=LR)
        gained_loss(fresh, batch(1, 1).to(target)).backward()
        fopt.step()                                  # state to be replaced by the load
        torch.cuda.manual_seed(999)
        info = ckpt.load(shared_tmp_path / "plain", model=fresh, optimizer=fopt, comm=comm,
                         state={"rng": ckpt.RNG()})

        def check():
            assert info.step == 7
            for k, v in fresh.state_dict().items():
                assert v.device.type == target.type, f"{k} on {v.device}, expected {target}"
                assert v.dtype == saved[k].dtype and torch.equal(v.cpu(), saved[k]), k
            for n, p in fresh.named_parameters():
                for k, v in fopt.state[p].items():
                    assert torch.equal(torch.as_tensor(v).cpu(), moments[(n, k)]), (n, k)
            assert torch.equal(torch.randn(5, device=device).cpu(), draws), "CUDA RNG not restored"
        check_all(check)
