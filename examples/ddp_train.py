"""Train a small model with torch DDP whose gradient averaging runs through mpicomm.

Run: mpiexec -n 2 python -m mpi4py examples/ddp_train.py
"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import mpicomm.distributed

mpicomm.distributed.init_process_group()               # dist.init_process_group("mpicomm") with MPI's rank/size
rank = dist.get_rank()

torch.manual_seed(0)                                   # same initial weights everywhere
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
gen = torch.Generator().manual_seed(rank)              # each rank its own data
for step in range(50):
    x = torch.randn(32, 8, generator=gen)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()                                    # buckets averaged by mpicomm all_reduce
    opt.step()
if rank == 0:
    print(f"DDP over mpicomm: final loss {loss.item():.4f}")
dist.destroy_process_group()
