"""FSDP2 (``fully_shard``) with int8 weight all-gathers and int8 gradient reduce-scatters.

Run:  mpiexec -n 2 python -m mpi4py examples/fsdp2_quantized.py

Two replicas of one model train on the same data: one with FSDP2's own bf16 collectives, one
with ``compressed.fsdp.quantize_comms`` (about half the bytes on the wire per collective). The
sharded fp32 parameters stay exact; only the gathered working copy and the gradients' trip
through the network are approximate, so the two runs stay close.
"""
import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import compressed
import mpicomm

comm = mpicomm.init()
dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=120))
mesh = init_device_mesh("cpu", (comm.size,))
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


def make_model(quantized: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if quantized:
        compressed.fsdp.quantize_comms(model, weight_bits=8, grad_bits=8)
    return model


def train(model: torch.nn.Module, steps: int = 30) -> float:
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + comm.rank)
        x = torch.randn(32, 64, generator=g)
        y = torch.tanh(x[:, :8].sum(dim=1, keepdim=True) / 3)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


exact, quantized = make_model(False), make_model(True)
loss_exact, loss_q = train(exact), train(quantized)
# full_tensor() gathers the exact fp32 masters with DTensor's own collective
gap = max(float((a.full_tensor() - b.full_tensor()).detach().abs().max())
          for a, b in zip(exact.parameters(), quantized.parameters()))
if comm.rank == 0:
    print(f"final loss: bf16 collectives {loss_exact:.5f}, int8 collectives {loss_q:.5f} "
          f"({loss_q / loss_exact:.3f}x); largest weight difference {gap:.2e}")
dist.destroy_process_group()
