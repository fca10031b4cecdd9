"""Train a small model with torch DDP, then with FSDP2, on the "mpicomm" torch.distributed backend.

Run: mpiexec -n 2 python -m mpi4py examples/ddp_train.py
"""
import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import mpicomm  # noqa: F401 - registers the "mpicomm" backend

# Rank and world size come from MPI; rank 0 hosts the store. Every call fails past the timeout.
dist.init_process_group("mpicomm", timeout=datetime.timedelta(minutes=5))
rank = dist.get_rank()


def make_model():
    torch.manual_seed(0)                               # same initial weights everywhere
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def train(model, steps=50):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)          # each rank its own data
    for _ in range(steps):
        x = torch.randn(32, 8, generator=gen)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()                                # gradient buckets reduced while backward runs
        opt.step()
    return loss.item()


ddp_loss = train(DDP(make_model()))

fsdp_model = make_model()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in fsdp_model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)                  # parameters sharded across ranks
fully_shard(fsdp_model, mesh=mesh)
fsdp_loss = train(fsdp_model)
if rank == 0:
    print(f"DDP over mpicomm: final loss {ddp_loss:.4f}; FSDP2 over mpicomm: final loss {fsdp_loss:.4f}")
dist.destroy_process_group()
