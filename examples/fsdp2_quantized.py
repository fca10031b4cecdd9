"""FSDP2 (``fully_shard``) with int8 weight all-gathers and int8 or 1-bit gradient
reduce-scatters.

Run:  mpiexec -n 2 python -m mpi4py examples/fsdp2_quantized.py

Three replicas of one model train on the same data: one with FSDP2's own bf16 collectives, one
with ``compressed.fsdp.quantize_comms`` (int8 both ways: about half the bytes on the wire per
collective) and one with 1-bit gradients (error feedback per module). The sharded fp32
parameters stay exact; only the gathered working copy and the gradients' trip through the
network are approximate, so the runs stay close. The 1-bit replica's error feedback is state:
``ckpt`` saves it beside the model as ``compressed.fsdp.GradientErrors``.
"""
import datetime
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import ckpt
import compressed
import mpicomm

comm = mpicomm.init()
dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=120))
mesh = init_device_mesh("cpu", (comm.size,))
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


def make_model(grad_bits: int | None) -> torch.nn.Module:  # None: FSDP2's own collectives
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if grad_bits is not None:
        compressed.fsdp.quantize_comms(model, weight_bits=8, grad_bits=grad_bits)  # 8 or 1
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


exact, q8, q1 = make_model(None), make_model(8), make_model(1)
loss_exact, loss_q8, loss_q1 = train(exact), train(q8), train(q1)
# full_tensor() gathers the exact fp32 masters with DTensor's own collective
gap = max(float((a.full_tensor() - b.full_tensor()).detach().abs().max())
          for a, b in zip(exact.parameters(), q8.parameters()))
if comm.rank == 0:
    print(f"final loss: bf16 collectives {loss_exact:.5f}, int8 collectives {loss_q8:.5f} "
          f"({loss_q8 / loss_exact:.3f}x), 1-bit gradients {loss_q1:.5f} "
          f"({loss_q1 / loss_exact:.3f}x); largest int8 weight difference {gap:.2e}")

# the 1-bit replica's checkpoint: fp32 masters and each module's error feedback (fp32)
tmp = comm.mpi_comm.bcast(tempfile.mkdtemp() if comm.rank == 0 else None, root=0)
ckpt.save(os.path.join(tmp, "q1"), model=q1, comm=comm,
          state={"grad_errors": compressed.fsdp.GradientErrors(q1)})
ckpt.load(os.path.join(tmp, "q1"), model=q1, comm=comm,
          state={"grad_errors": compressed.fsdp.GradientErrors(q1)})  # at any rank count
comm.mpi_comm.Barrier()
if comm.rank == 0:
    shutil.rmtree(tmp)
    print("saved and loaded the 1-bit replica with its gradient errors")
dist.destroy_process_group()
