"""``bench train --curve``: the 1-bit optimizers' loss curves against their exact references.

Adam and LAMB train on gradients averaged with mpicomm, ``compressed.OnebitAdam``,
``ZeroOneAdam`` and ``OnebitLamb`` on their own communication; every run starts from the same
weights and sees the same data, a step of each in turn. ``--curve-fsdp`` adds FSDP2 with Adam
on the mpicomm group (``fsdp2-mpicomm-r16``, and ``fsdp2-mpicomm-q8`` with ``compressed.fsdp``'s
int8 weights and gradients), as ``bench train``'s peers of those names.
"""
from __future__ import annotations

import time

from mpi4py import MPI

from mpicomm import format_bytes

from . import common
from .lamb import Lamb
from .train_peers import batch, build_model, describe, make_fsdp_peer

__all__ = ["CURVES", "FSDP_CURVES", "run_curve", "curve_main"]

CURVES = ("adam", "onebit-adam", "zero-one-adam", "lamb", "onebit-lamb")
FSDP_CURVES = ("fsdp2-mpicomm-r16", "fsdp2-mpicomm-q8", "fsdp2-mpicomm-q1")  # --curve-fsdp


def _counting_comm(mpi_comm):
    """An mpicomm Communicator (on a duplicate of ``mpi_comm``) counting the bytes this rank
    hands its collectives for other ranks (all_reduce as a ring: 2 (p - 1) / p of the buffer)."""
    import mpicomm

    class Counting(mpicomm.Communicator):
        sent = 0

        def all_to_all_single(self, output, input, async_op=False):
            self.sent += (self.size - 1) * input.numel() * input.element_size() // self.size
            return super().all_to_all_single(output, input, async_op=async_op)

        def all_gather_into_tensor(self, output, input, async_op=False):
            self.sent += (self.size - 1) * input.numel() * input.element_size()
            return super().all_gather_into_tensor(output, input, async_op=async_op)

        def all_reduce(self, tensor, op="sum", async_op=False):
            self.sent += 2 * (self.size - 1) * tensor.numel() * tensor.element_size() // self.size
            return super().all_reduce(tensor, op=op, async_op=async_op)

    return Counting(mpi_comm.Dup())


def _curve_optimizer(name: str, params, args, comm):
    import torch

    import compressed

    if name == "adam":
        return torch.optim.Adam(params, lr=args.lr)
    if name == "onebit-adam":
        return compressed.OnebitAdam(params, lr=args.lr, freeze_step=args.freeze_step, comm=comm)
    if name == "zero-one-adam":
        return compressed.ZeroOneAdam(params, lr=args.lr, var_freeze_step=args.freeze_step,
                                      var_update_scaler=args.var_update_scaler,
                                      local_step_scaler=args.local_step_scaler,
                                      local_step_clipper=args.local_step_clipper, comm=comm)
    if name == "lamb":
        return Lamb(params, lr=args.lr)
    return compressed.OnebitLamb(params, lr=args.lr, freeze_step=args.freeze_step, comm=comm)


def run_curve(args, mpi_comm, mcomm, teacher) -> dict[str, dict]:
    """Collective: train from the same start with each optimizer of ``CURVES``, a step of each in
    turn (Adam and LAMB on gradients averaged with mpicomm); per optimizer the mean loss over
    ranks at every step, the bytes this rank sent per step (counted at its communicator) and
    the step time (forward, backward, communication and update; max over ranks, mean over steps)."""
    import torch

    import compressed

    rank, n = mpi_comm.Get_rank(), mpi_comm.Get_size()
    compressed.OnebitAllreduce(mcomm)(torch.ones(1024), key="warm-up")   # load the kernels untimed
    runs = {}
    for name in CURVES:
        model = build_model(args, seed=0)
        comm = _counting_comm(mpi_comm)
        runs[name] = {"model": model, "comm": comm, "losses": [], "times": [],
                      "opt": _curve_optimizer(name, model.parameters(), args, comm)}
    if getattr(args, "curve_fsdp", False):
        import torch.distributed as dist

        groups = {"gloo": common.init_gloo(mpi_comm)}
        groups["mpicomm"] = dist.new_group(backend="mpicomm")
        for name in FSDP_CURVES:
            peer = make_fsdp_peer(name, args, groups)
            runs[name] = {"model": peer.ddp, "comm": None, "losses": [], "times": [],
                          "opt": peer.opt, "dtype": peer.dtype or torch.bfloat16}

    def average_grads(model, comm):
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, op="avg")
        torch.nn.utils.vector_to_parameters(flat, grads)

    for step in range(args.curve_steps):
        x, y = batch(args, rank, step, teacher)
        for name, run in runs.items():
            model, opt = run["model"], run["opt"]
            opt.zero_grad(set_to_none=False)
            mpi_comm.Barrier()
            t0 = time.perf_counter()
            dtype = run.get("dtype")
            out = model(x) if dtype is None else model(x.to(dtype)).float()
            loss = torch.nn.functional.mse_loss(out, y)
            loss.backward()
            if name in ("adam", "lamb") and n > 1:
                average_grads(model, run["comm"])
            opt.step()
            run["times"].append(time.perf_counter() - t0)
            run["losses"].append(mpi_comm.allreduce(float(loss.detach()), op=MPI.SUM) / n)
    out = {}
    for name, run in runs.items():
        comm = run["comm"]  # None: FSDP2 on its process group (bytes not counted)
        out[name] = {"losses": run["losses"],
                     "bytes_per_step": None if comm is None else comm.sent / args.curve_steps,
                     "step_ms": mpi_comm.allreduce(sum(run["times"]) / len(run["times"]), op=MPI.MAX) * 1e3}
        if comm is not None:
            comm.free()
    return out


CURVE_COLUMNS = (common.Column("step", "step", 7, "d"),) + tuple(
    common.Column(name, name, 14, ".6f") for name in CURVES)
SUMMARY_COLUMNS = (
    common.Column("peer", "optimizer", 14),
    common.Column("final_loss", "final loss", 12, ".6f"),
    common.Column("bytes_per_step", "bytes/step", 12, ".0f"),
    common.Column("step_ms", "step(ms)", 9, ".2f"),
)


def curve_main(args, mpi_comm, mcomm, teacher, rep) -> int:
    """Collective: the --curve program after the header: train, print the losses and a summary
    per optimizer, emit one ``curve`` record each; 1 if a loss is not finite."""
    import numpy as np

    curves = run_curve(args, mpi_comm, mcomm, teacher)
    records = []
    for name, c in curves.items():
        series = c["losses"]
        bad = int(not np.all(np.isfinite(series)))
        compressed_from = args.freeze_step if name in ("onebit-adam", "onebit-lamb") else None
        sent = c["bytes_per_step"]
        label = name if sent is None else f"{name} ({format_bytes(sent)}/step)"
        records.append(dict(rep.base("curve"), peer=name, model=describe(args), steps=len(series),
                            losses=series, final_loss=series[-1], freeze_step=compressed_from,
                            bytes_per_step=sent, step_ms=c["step_ms"], label=label, wrong=bad))
    every = max(1, args.curve_steps // 10)
    for i in sorted(set(range(every - 1, args.curve_steps, every)) | {args.curve_steps - 1}):
        rep.show({"step": i + 1, **{name: curves[name]["losses"][i] for name in CURVES}})
    rep.section("per optimizer: final loss, bytes this rank sent per step (mean, counted at its "
                "communicator), step time (forward + backward + communication + update; mean "
                "over steps, max over ranks)", SUMMARY_COLUMNS)
    for rec in records:
        rep.emit(rec)
    a, b = curves["adam"]["losses"][-1], curves["onebit-adam"]["losses"][-1]
    rep.note(f"loss after {args.curve_steps} steps: Adam {a:.6f}, 1-bit Adam {b:.6f} "
             f"({b / a if a else float('nan'):.2f}x Adam's; compressed from step "
             f"{args.freeze_step + 1})")
    if all(name in curves for name in FSDP_CURVES):
        r16, q8, q1 = (curves[name]["losses"][-1] for name in FSDP_CURVES)

        def ratio(x: float) -> str:
            return f"{x / r16 if r16 else float('nan'):.3f}x r16's"
        rep.note(f"loss after {args.curve_steps} steps: FSDP2 Adam {r16:.6f} (fsdp2-mpicomm-r16), "
                 f"{q8:.6f} with int8 weights and gradients (fsdp2-mpicomm-q8): {ratio(q8)}, "
                 f"{q1:.6f} with int8 weights and 1-bit gradients (fsdp2-mpicomm-q1): "
                 f"{ratio(q1)} (bytes/step '-': not counted)")
    return rep.finish("all losses finite (#wrong = 0)",
                      title=f"{describe(args)}, {mpi_comm.Get_size()} ranks: exact and 1-bit optimizers")
