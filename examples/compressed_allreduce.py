"""1-bit compressed allreduce with error feedback, next to the exact mean.

Run: mpiexec -n 2 python -m mpi4py examples/compressed_allreduce.py
"""
import torch

import compressed
import mpicomm

comm = mpicomm.init()
ar = compressed.OnebitAllreduce(comm)                  # keeps worker/server error buffers per key
gen = torch.Generator().manual_seed(comm.rank)
grad = torch.randn(1_000_000, generator=gen)           # this rank's gradient

exact = grad.clone()
comm.all_reduce(exact, op="avg")                        # fp32 reference

running = torch.zeros_like(grad)
for step in range(1, 9):                                # the same gradient, again and again:
    running += ar(grad, key="layer1.weight")            # error feedback makes the average converge
    err = (running / step - exact).norm() / exact.norm()
    if comm.rank == 0 and step in (1, 2, 8):
        print(f"after {step} calls: relative error of the averaged estimate {err:.3f}")
share = 2 * (comm.size - 1) / comm.size                 # bandwidth-optimal allreduce: bytes sent per rank
one_bit = share * compressed.padded_size(grad.numel(), comm.size) / 8
fp32 = share * grad.numel() * 4
if comm.rank == 0:
    print(f"bytes sent per rank and call: {one_bit / 1e6:.3f} MB instead of {fp32 / 1e6:.1f} MB")
