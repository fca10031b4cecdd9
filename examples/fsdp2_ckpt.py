"""Checkpoint an FSDP2 model (``fully_shard``) and its AdamW state with ckpt, resume at any size.

Run:  mpiexec -n 2 python -m mpi4py examples/fsdp2_ckpt.py DIR   # trains, saves DIR/step3, resumes
      mpiexec -n 3 python -m mpi4py examples/fsdp2_ckpt.py DIR   # resumes the same checkpoint at 3 ranks
      mpiexec -n 1 python -m mpi4py examples/fsdp2_ckpt.py DIR   # ... at 1 rank, also into a plain module

Each rank writes only its own shards into DIR/step3/data.bin (one safetensors file holding the full
tensors) and reads back only the shards its new placement needs.
"""
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckpt
import mpicomm

comm = mpicomm.init()
dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=120))  # torch.distributed over MPI
mesh = init_device_mesh("cpu", (comm.size,))
root = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("MPICOMM_EXAMPLE_DIR") or tempfile.gettempdir()
run_dir = os.path.join(root, "fsdp2-run")


def make_model(shard=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 37), torch.nn.ReLU(), torch.nn.Linear(37, 5))
    if shard:
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)   # parameters become DTensors: Shard(0) over the mesh
        fully_shard(model, mesh=mesh)
    return model


def train(model, opt, steps):
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + comm.rank))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


# 1. the first run trains and saves (collective: each rank writes its shards with MPI-IO)
if not os.path.exists(os.path.join(run_dir, "latest")):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = train(model, opt, 3)
    ckpt.save(os.path.join(run_dir, "step3"), model=model, optimizer=opt, step=3, comm=comm,
              state={"rng": ckpt.RNG()})
    if comm.rank == 0:
        print(f"trained 3 steps at {comm.size} ranks (loss {loss:.4f}), saved {run_dir}/step3")

# 2. any run resumes: FSDP2 at this job's size; each rank reads only its new shards
model = make_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
info = ckpt.load(run_dir, model=model, optimizer=opt, comm=comm, state={"rng": ckpt.RNG(lambda s, r, n: s[0])})
weights = {name: p.full_tensor().clone() for name, p in model.state_dict().items()}  # gathered by DTensor
if comm.rank == 0:
    from safetensors.torch import load_file   # data.bin is a plain safetensors file of full tensors

    on_disk = load_file(os.path.join(info.path, "data.bin"))
    same = all(torch.equal(on_disk[name], w) for name, w in weights.items())
    print(f"saved at {info.world_size} ranks, step {info.step}; resumed at {comm.size} ranks: "
          f"weights equal the file's: {same}; AdamW step {int(opt.state[model[0].weight]['step'])}")
    if not same:
        sys.exit(1)
print(f"rank {comm.rank}: one more step, loss {train(model, opt, 1):.4f}", flush=True)

# 3. at one rank, the same checkpoint also loads into a plain (unsharded) module and optimizer
if comm.size == 1:
    plain = make_model(shard=False)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    ckpt.load(run_dir, model=plain, optimizer=plain_opt, comm=comm, state={"rng": ckpt.RNG(lambda s, r, n: s[0])})
    print(f"plain module: weights equal: {all(torch.equal(plain.state_dict()[k], w) for k, w in weights.items())}")
dist.destroy_process_group()
