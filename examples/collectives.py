"""mpicomm collectives on torch tensors and numpy arrays.

Run: mpiexec -n 2 python -m mpi4py examples/collectives.py
"""
import numpy as np
import torch

import mpicomm

comm = mpicomm.init()                                   # the world communicator
rank, size = comm.rank, comm.size

grad = torch.full((4,), float(rank + 1))
comm.all_reduce(grad, op=mpicomm.ReduceOp.AVG)          # in place, like torch.distributed
assert torch.equal(grad, torch.full((4,), (size + 1) / 2))

shard = torch.arange(3, dtype=torch.bfloat16) + 10 * rank
full = torch.empty(3 * size, dtype=torch.bfloat16)
comm.all_gather_into_tensor(full, shard)                # rank order

summed = np.empty(2)
comm.reduce_scatter_tensor(summed, np.arange(2.0 * size))  # numpy works too
assert np.array_equal(summed, size * np.arange(2.0 * size)[2 * rank:2 * rank + 2])

work = comm.broadcast(torch.arange(5), src=0, async_op=True)  # MPI non-blocking under the hood
work.wait()

evens = comm.split(color=rank % 2)                      # sub-communicator
evens.barrier()

if rank == 0:
    print(f"{size} ranks: avg={grad.tolist()} all_gather={full.float().tolist()}")
