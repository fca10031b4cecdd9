"""Save sharded training state on 2 ranks, load it on 1 rank and at another ZeRO stage: no conversion.

Run: mpiexec -n 2 python -m mpi4py examples/ckpt_reshard.py [DIR]
"""
import os
import sys
import tempfile

import torch

import ckpt
from zero import ZeroOptimizer
import mpicomm

comm = mpicomm.init()
root = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("MPICOMM_EXAMPLE_DIR") or tempfile.gettempdir()
run_dir = comm.mpi_comm.bcast(os.path.join(root, f"ckpt-example-{os.getpid()}"), root=0)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))


def train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()              # ZeroOptimizer: reduce-scatter grads, update own shard, all-gather
    return loss.item()


# 1. train at 2 ranks with ZeRO stage 1 and save (collective MPI-IO: every byte written once)
model = make_model()
opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=1, comm=comm, lr=1e-2)
train(model, opt, 5, seed=comm.rank)
ckpt.save(os.path.join(run_dir, "step5"), model=model, optimizer=opt, step=5, comm=comm)

# 2. load it on a 1-rank communicator, at ZeRO stage 2: each rank reads only its own bytes
solo = comm.split(0 if comm.rank == 0 else None)
if solo is not None:
    model1 = make_model()
    opt1 = ZeroOptimizer(torch.optim.Adam, model1.parameters(), stage=2, comm=solo, lr=1e-2)
    info = ckpt.load(run_dir, model=model1, optimizer=opt1, comm=solo)   # follows run_dir/latest
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  model1.state_dict().values()))
    print(f"saved at {info.world_size} ranks (stage {info.stage}), step {info.step}; "
          f"loaded on 1 rank at stage 2: weights identical: {same}")
    # 3. or into a plain torch optimizer with the full state
    model2 = make_model()
    plain = torch.optim.Adam(model2.parameters(), lr=1e-2)
    ckpt.load(run_dir, model=model2, optimizer=plain, comm=solo)
    print(f"plain Adam resumed at step {int(plain.state[model2[0].weight]['step'])}; "
          f"one more step, loss {train(model2, plain, 1, seed=7):.4f}")
    solo.free()
comm.barrier()
