"""FSDP2 with 1-bit gradients: the loss with and without a full-precision warm-up.

``mpiexec -n 2 python -m mpi4py -m bench onebit_warmup [--steps 80] [--lr 3e-3]
[--warmups 0,20] [--seeds 3] [--json F] [--plot F.png]``

A small regression (three ``fully_shard`` Linear layers and the model, fp32, Adam; each rank
fits its own fixed batch to one linear teacher, deep enough in 80 steps that gradient noise
shows) trains from the same start, for each seed, with:

- ``exact``: FSDP2's own collectives;
- ``w-exact-g8``: exact weights, int8 gradient reduce-scatters (``weight_bits=None``);
- ``w8-g-exact``: int8 weight all-gathers, exact gradients (``grad_bits=None``);
- ``q8``: int8 weights and gradients (``quantize_comms(weight_bits=8, grad_bits=8)``);
- ``q1-wN``: int8 weights and 1-bit gradients after ``N`` full-precision steps
  (``quantize_comms(weight_bits=8, grad_bits=1, warmup_steps=N)``), one per ``--warmups``.

What a user learns: how far 1-bit gradients leave the loss behind int8 ones after a short run,
how much a warm-up recovers, and what bounds int8's own loss (the weights or the gradients).
The final loss per run (mean over ranks and seeds; each seed's too) and its ratio to ``q8``'s
and to ``exact``'s are printed; ``--plot`` draws the first seed's curves.
"""
from __future__ import annotations

import argparse

from mpi4py import MPI

from . import common

BENCH = "onebit_warmup"

COLUMNS = (common.Column("peer", "run", 12), common.Column("warmup", "warm-up", 8),
           common.Column("final_loss", "final loss", 12, ".3e"),
           common.Column("x_q8", "x q8", 7, ".3f"), common.Column("x_exact", "x exact", 8, ".3f"),
           common.Column("seed_losses", "per seed", 40))
STEP_COLUMNS_WIDTH = 11


def _runs(warmups: list[int]) -> dict[str, dict]:
    """run name -> quantize_comms arguments (None: FSDP2's own collectives)."""
    runs: dict[str, dict | None] = {
        "exact": None,
        "w-exact-g8": {"weight_bits": None, "grad_bits": 8},
        "w8-g-exact": {"weight_bits": 8, "grad_bits": None},
        "q8": {"weight_bits": 8, "grad_bits": 8},
    }
    for w in warmups:
        runs[f"q1-w{w}"] = {"weight_bits": 8, "grad_bits": 1, "warmup_steps": w}
    return runs


def _model(args, seed: int, mesh, quant: dict | None):
    import torch
    from torch.distributed.fsdp import fully_shard

    import compressed.fsdp

    torch.manual_seed(seed)
    h = args.hidden
    model = torch.nn.Sequential(torch.nn.Linear(args.inputs, h), torch.nn.Tanh(),
                                torch.nn.Linear(h, h), torch.nn.Tanh(), torch.nn.Linear(h, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if quant is not None:
        compressed.fsdp.quantize_comms(model, **quant)
    return model


def train(args, mpi_comm, mesh, seed: int, quant: dict | None) -> list[float]:
    """Collective: ``args.steps`` Adam steps on this rank's fixed batch; the loss at each step,
    mean over ranks."""
    import torch

    rank, n = mpi_comm.Get_rank(), mpi_comm.Get_size()
    teacher = torch.randn(args.inputs, 1, generator=torch.Generator().manual_seed(1000 + seed))
    teacher *= args.teacher_scale / args.inputs ** 0.5
    x = torch.randn(args.batch, args.inputs,
                    generator=torch.Generator().manual_seed(seed * 1_000_003 + rank))
    y = x @ teacher
    model = _model(args, seed, mesh, quant)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for _ in range(args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(mpi_comm.allreduce(float(loss.detach()), op=MPI.SUM) / n)
    return losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench onebit_warmup", description=__doc__.split(
        "\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=80, help="training steps per run (80)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (3e-3)")
    p.add_argument("--warmups", type=common.comma_list(), default=["0", "20"],
                   help="1-bit runs' warmup_steps, comma separated (0,20)")
    p.add_argument("--seeds", type=int, default=3, help="starts (weights, teacher, data) (3)")
    p.add_argument("--inputs", type=int, default=8, help="input features (8)")
    p.add_argument("--hidden", type=int, default=32, help="hidden width (32)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank, the same each step (32)")
    p.add_argument("--teacher-scale", type=float, default=0.05,
                   help="the linear teacher's weight scale (0.05: small targets, a deep fit)")
    p.add_argument("--json", metavar="FILE", help="write one JSON record per run and seed")
    p.add_argument("--plot", metavar="FILE.png", help="draw the first seed's loss curves")
    args = p.parse_args(argv)
    try:
        warmups = [int(w) for w in args.warmups]
    except ValueError:
        p.error(f"--warmups: expected whole numbers, got {args.warmups}")
    if args.steps < 1 or args.seeds < 1 or min(warmups, default=0) < 0:
        p.error("--steps and --seeds must be >= 1, --warmups >= 0")

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import mpicomm  # noqa: F401 - registers the backend

    mpi_comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("mpicomm")
    group = dist.group.WORLD if dist.get_backend() == "mpicomm" else dist.new_group(
        backend="mpicomm")
    mesh = DeviceMesh.from_group(group, "cpu")
    rep = common.Reporter(BENCH, mpi_comm, args, COLUMNS)
    rep.start(dtype="float32", iterations=f"{args.steps} steps x {args.seeds} seeds per run",
              extra=[f"model: Linear({args.inputs}, {args.hidden}), Tanh, Linear({args.hidden}, "
                     f"{args.hidden}), Tanh, Linear({args.hidden}, 1); each Linear and the model "
                     f"fully_shard; Adam lr {args.lr}; a fixed batch of {args.batch} per rank, linear "
                     f"teacher of scale {args.teacher_scale}"])
    runs = _runs(warmups)
    curves: dict[str, list[list[float]]] = {name: [] for name in runs}
    for seed in range(args.seeds):
        for name, quant in runs.items():
            curves[name].append(train(args, mpi_comm, mesh, seed, quant))
    final = {name: sum(c[-1] for c in cs) / len(cs) for name, cs in curves.items()}
    every = max(1, args.steps // 8)
    marks = sorted(set(range(every - 1, args.steps, every)) | {args.steps - 1})
    rep.section("loss at step (mean over ranks and seeds)", (common.Column("step", "step", 6, "d"),)
                + tuple(common.Column(name, name, STEP_COLUMNS_WIDTH, ".3e") for name in runs))
    for i in marks:
        rep.show({"step": i + 1, **{name: sum(c[i] for c in cs) / len(cs)
                                    for name, cs in curves.items()}})
    rep.section(f"final loss after {args.steps} steps (mean over ranks and seeds), its ratio to "
                "q8's and to exact's", COLUMNS)
    for name, quant in runs.items():
        w = quant.get("warmup_steps") if quant else None
        seeds = ", ".join(f"{c[-1]:.3e}" for c in curves[name])
        rep.emit(dict(rep.base("curve"), peer=name, warmup=w, final_loss=final[name],
                      x_q8=final[name] / final["q8"], x_exact=final[name] / final["exact"],
                      seed_losses=seeds, losses=curves[name][0], steps=args.steps,
                      freeze_step=w or None, label=name, wrong=0))
    return rep.finish("all runs done", title=f"FSDP2, {mpi_comm.Get_size()} ranks: int8 and "
                      "1-bit gradients, with and without a warm-up (seed 0)")


if __name__ == "__main__":
    raise SystemExit(main())
