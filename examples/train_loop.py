"""A training loop with ZeroOptimizer: bf16 weights, gradient accumulation, global clipping, an LR
schedule, skipped non-finite steps and a checkpoint every few steps, then a resume from the latest.

Run: mpiexec -n 2 python -m mpi4py examples/train_loop.py [DIR]
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
run_dir = comm.mpi_comm.bcast(os.path.join(root, f"train-loop-{os.getpid()}"), root=0)
torch.set_num_threads(1)

STEPS, MICRO, SAVE_EVERY, MAX_NORM = 12, 4, 4, 1.0


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(torch.bfloat16)


def make_optimizer(model):
    opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), stage=1, comm=comm,
                             skip_nonfinite=True, lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    return opt, sched


def micro_batch(step, micro):
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + comm.rank)   # each rank its own data
    x = torch.randn(16, 32, generator=g)
    return x.to(torch.bfloat16), torch.sin(x[:, :8] * 2)


def train(model, opt, sched, start, stop):
    for step in range(start, stop):
        opt.zero_grad()
        for micro in range(MICRO):
            x, y = micro_batch(step, micro)
            loss = torch.nn.functional.mse_loss(model(x).float(), y) / MICRO   # mean over micro-batches
            if micro < MICRO - 1:
                with opt.no_sync():          # accumulate locally; only the last backward communicates
                    loss.backward()
            else:
                loss.backward()              # gradient buckets are reduce-scattered as backward runs
        norm = opt.clip_grad_norm_(MAX_NORM)   # norm of the averaged gradient, all ranks and parameters
        opt.step()                             # skipped on every rank alike if a gradient was inf/NaN
        sched.step()
        if (step + 1) % SAVE_EVERY == 0:
            ckpt.save(os.path.join(run_dir, f"step{step + 1}"), model=model, optimizer=opt, step=step + 1,
                      comm=comm, extra={"scheduler": sched.state_dict()}, overwrite=True)
        if comm.rank == 0:
            print(f"step {step + 1:2d}  loss {loss.item() * MICRO:.4f}  grad norm {norm.item():.3f}  "
                  f"lr {sched.get_last_lr()[0]:.2e}")


model = make_model()
opt, sched = make_optimizer(model)
train(model, opt, sched, 0, STEPS)
final = [p.detach().clone() for p in model.parameters()]

# resume from step 8 (as after a crash) and train to the end again: the same weights
model2 = make_model()
opt2, sched2 = make_optimizer(model2)
info = ckpt.load(os.path.join(run_dir, "step8"), model=model2, optimizer=opt2, comm=comm)
sched2.load_state_dict(info.extra["scheduler"])
train(model2, opt2, sched2, info.step, STEPS)
same = all(torch.equal(a, b) for a, b in zip(final, model2.parameters()))
ok = comm.mpi_comm.allreduce(int(same), op=__import__("mpi4py").MPI.MIN)
if comm.rank == 0:
    print(f"resumed from step {info.step}: final weights {'identical' if ok else 'DIFFERENT'} "
          f"({opt.skipped_steps} steps skipped)")
if not ok:
    sys.exit(1)
