"""0/1 Adam and 1-bit LAMB training a small model, and DeepSpeed's compressed_allreduce through
CompressedBackend, all on a torch.distributed process group ("mpicomm"; gloo works the same).

Run: mpiexec -n 2 python -m mpi4py examples/onebit_family.py
"""
import datetime

import torch
import torch.distributed as dist

import compressed
import mpicomm  # noqa: F401 - registers the "mpicomm" backend

dist.init_process_group("mpicomm", timeout=datetime.timedelta(minutes=5))
rank, size = dist.get_rank(), dist.get_world_size()
group = dist.new_group(backend="mpicomm")              # any process group will do


def same_on_all_ranks(t: torch.Tensor) -> bool:
    """Whether ``t`` is bitwise equal to rank 0's (the same answer on every rank)."""
    ref = t.clone()
    dist.broadcast(ref, src=0)
    ok = torch.tensor([float(torch.equal(ref, t))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


# DeepSpeed's compressed_allreduce, on the process group
backend = compressed.CompressedBackend(group)
n = 10_000
worker_error = torch.zeros(compressed.padded_size(n, size))  # error feedback, kept across calls
server_error = torch.zeros(compressed.padded_size(n, size) // size)
grad = torch.randn(n, generator=torch.Generator().manual_seed(rank))
exact = grad.clone()
dist.all_reduce(exact, group=group)
exact /= size
running = torch.zeros(n)
for call in range(1, 9):
    buffer_m = grad.clone()
    backend.compressed_allreduce(buffer_m, worker_error, server_error, 0)  # in place: the mean
    running += buffer_m
assert same_on_all_ranks(buffer_m), "ranks disagree on the compressed mean"
err = float((running / 8 - exact).norm() / exact.norm())
if rank == 0:
    print(f"CompressedBackend on {dist.get_backend(group)}: relative error of 8 averaged calls {err:.3f}")


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)                               # same initial weights everywhere
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def train(make_optimizer, steps: int = 40):
    model = make_model()
    opt = make_optimizer(model.parameters())
    gen = torch.Generator().manual_seed(rank)          # each rank its own data
    test = torch.randn(256, 8, generator=torch.Generator().manual_seed(1234))
    losses = []
    for _ in range(steps):
        with torch.no_grad():
            losses.append(float((model(test) - test.sum(dim=1, keepdim=True)).pow(2).mean()))
        x = torch.randn(32, 8, generator=gen)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()                                # no DDP: the optimizer averages over ranks
        opt.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return opt, losses, weights


zoadam, zo_losses, zo_weights = train(lambda params: compressed.ZeroOneAdam(
    params, lr=1e-2, var_freeze_step=20, var_update_scaler=2, local_step_scaler=4,
    local_step_clipper=4, comm=group))
lamb, lamb_losses, lamb_weights = train(lambda params: compressed.OnebitLamb(
    params, lr=5e-2, freeze_step=20, comm=group))

# 0/1 Adam's ranks step locally between syncs; at a sync their weights are equal again
assert zoadam.last_round == "sync", zoadam.last_round
assert same_on_all_ranks(zo_weights), "ranks disagree on the 0/1 Adam weights after a sync"
assert same_on_all_ranks(lamb_weights), "ranks disagree on the 1-bit LAMB weights"
for name, losses in (("ZeroOneAdam", zo_losses), ("OnebitLamb", lamb_losses)):
    assert losses[-1] < losses[0] / 2, (name, losses[0], losses[-1])
    if rank == 0:
        print(f"{name}: test loss {losses[0]:.3f} -> {losses[-1]:.3f}, weights equal on {size} ranks")
dist.destroy_process_group()
