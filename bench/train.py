"""End-to-end data-parallel training: DDP and FSDP2 on mpicomm and on gloo, and DDP hooks.

``mpiexec -n P python -m bench train [--model mlp|transformer] [--hidden H] [--layers L]
[--batch B] [--steps N] [--rounds R] [--dtype float32|bfloat16] [--peers ...] [--json F]``

Peers (each its own replica of the same model, same initial weights, same data):

- ``mpicomm``: ``DistributedDataParallel`` on an mpicomm process group;
- ``gloo``: DDP on a gloo process group (the reference the others' weights are checked against);
- ``mpicomm-hook``: DDP on gloo with ``mpicomm.distributed.allreduce_ddp_hook`` (gradients via mpicomm);
- ``onebit-hook``: DDP on gloo with ``compressed.onebit_ddp_hook`` (compressed after the warm-up);
- ``fsdp2-mpicomm-r32``, ``fsdp2-gloo-r32``, ``fsdp2-mpicomm-r16``, ``fsdp2-gloo-r16``: FSDP2
  (``fully_shard`` on every layer and the model) on a DeviceMesh over the mpicomm or the gloo
  group, ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32 (r32) or bfloat16
  (r16))``: bf16 compute, gradients reduce-scattered in the reduce dtype;
- ``fsdp2-mpicomm-q8``: ``fsdp2-mpicomm-r16`` with ``compressed.fsdp.quantize_comms`` (int8
  weight all-gathers and gradient reduce-scatters); step time compared with r16's;
- ``fsdp2-mpicomm-q1``: the same with 1-bit gradient reduce-scatters (``grad_bits=1``).

``--dtype bfloat16`` runs the DDP peers on a bfloat16 model (bf16 gradients in DDP's buckets);
the FSDP2 peers always keep float32 master weights and compute in bfloat16.

Each round runs, for every peer in turn (the order rotating): ``--steps`` training steps (Adam;
timed: forward + backward with DDP's communication), the same number of backward passes under
``no_sync`` (backward alone), and of one all-reduce of all gradients through the peer's path
(communication alone). ``overlap_ms = backward_ms + comm_ms - backward_comm_ms``: how much of the
communication hid behind the backward. Records are the median round, with min/max.

``--curve`` trains instead, from the same start, with Adam and LAMB (gradients averaged with
mpicomm) and with ``compressed.OnebitAdam``, ``ZeroOneAdam`` and ``OnebitLamb``, and reports the
loss at every step (``--plot`` draws it, bytes per step in the legend), the final loss, the bytes
each sent per step and the step time: what 1-bit compression costs in convergence and saves on
the wire.

Where the parts live: ``bench.train_peers`` (model, data, the peers, a round, the weight checks),
``bench.train_curve`` (``--curve``), ``bench.lamb`` (its exact LAMB reference); here the
arguments, the header and the step records.
"""
from __future__ import annotations

import argparse
import sys
import warnings

from mpi4py import MPI

from . import common, models
from .train_curve import CURVE_COLUMNS, curve_main
from .train_parts import parts_text
from .train_peers import (FSDP_PEERS, PEERS, build_model, check_peers, describe, grad_dtype_of,
                          make_peer, reference_of, run_round, tolerance, warm_up)

DTYPES = ("float32", "bfloat16")
BENCH = "train"

__all__ = ["PEERS", "DTYPES", "main"]


# ---------------------------------------------------------------------------------------------
# the program

COLUMNS = (
    common.Column("peer", "peer", 17),
    common.Column("step_ms", "step(ms)", 9, ".2f"),
    common.Column("step_ms_min", "min(ms)", 9, ".2f"),
    common.Column("step_ms_max", "max(ms)", 9, ".2f"),
    common.Column("samples_per_s", "samples/s", 10, ".0f"),
    common.Column("backward_comm_ms", "bwd+comm", 9, ".2f"),
    common.Column("backward_ms", "bwd(ms)", 9, ".2f"),
    common.Column("comm_ms", "comm(ms)", 9, ".2f"),
    common.Column("overlap_ms", "overlap", 9, ".2f"),
    common.Column("loss", "loss", 10, ".5f"),
    common.Column("wrong", "#wrong", 7, "d"),
)


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpiexec -n P python -m bench train",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    p.add_argument("--hidden", type=_count(8), default=1024, help="width (default 1024)")
    p.add_argument("--layers", type=_count(1), default=4, help="layers or blocks (default 4)")
    p.add_argument("--heads", type=_count(1), default=8, help="attention heads (default 8)")
    p.add_argument("--seq", type=_count(1), default=32, help="transformer sequence length (32)")
    p.add_argument("--batch", type=_count(1), default=32, help="samples per rank and step (32)")
    p.add_argument("--steps", type=_count(1), default=10, help="timed steps per round (10)")
    p.add_argument("--warmup", type=_count(0), default=3, help="untimed steps first (3)")
    common.add_rounds_arg(p)
    p.add_argument("--peers", type=common.comma_list(PEERS), default=list(PEERS),
                   help=f"comma list (default all: {','.join(PEERS)})")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="the DDP peers' model and gradient dtype (default float32; the FSDP2 "
                        "peers always compute in bfloat16)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb (25)")
    p.add_argument("--fsdp-prefetch", action="store_true",
                   help="FSDP2 peers: explicit prefetching with async unshards (the next "
                        "layer's all-gather issued during this layer's forward / backward)")
    p.add_argument("--parts", action="store_true",
                   help="FSDP2 peers: split the step into compute and the collectives' pack, "
                        "wire and unpack time (bench.train_parts)")
    p.add_argument("--onebit-warmup", type=_count(0), default=None,
                   help="steps the 1-bit hook averages exactly (default: --warmup - 1, so the "
                        "last warm-up step and every timed step are compressed)")
    p.add_argument("--onebit-min-bucket", type=_count(0), default=0,
                   help="buckets under this many elements go uncompressed (default 0)")
    p.add_argument("--curve", action="store_true",
                   help="instead: loss against step for Adam, OnebitAdam, ZeroOneAdam, LAMB, OnebitLamb")
    p.add_argument("--curve-steps", type=_count(1), default=100, help="steps of --curve (100)")
    p.add_argument("--curve-fsdp", action="store_true",
                   help="with --curve: also FSDP2 + Adam, fsdp2-mpicomm-r16, -q8 and -q1")
    p.add_argument("--freeze-step", type=_count(1), default=20,
                   help="--curve: OnebitAdam's and OnebitLamb's freeze_step, ZeroOneAdam's "
                        "var_freeze_step (default 20)")
    p.add_argument("--var-update-scaler", type=_count(1), default=4,
                   help="--curve: ZeroOneAdam's var_update_scaler (default 4; DeepSpeed's 16)")
    p.add_argument("--local-step-scaler", type=_count(1), default=8,
                   help="--curve: ZeroOneAdam's local_step_scaler (default 8; DeepSpeed's 32678)")
    p.add_argument("--local-step-clipper", type=_count(1), default=8,
                   help="--curve: ZeroOneAdam's local_step_clipper (default 8; DeepSpeed's 16)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the records to FILE")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="with --curve: draw the loss curves (needs matplotlib)")
    return p


def _header(args, ranks: int, params: int) -> tuple[str, list[str]]:
    """The header's iteration schedule and extra lines."""
    what = (f"{args.curve_steps} steps of each optimizer, freeze_step {args.freeze_step}; "
            f"ZeroOneAdam var_update_scaler {args.var_update_scaler}, local_step_scaler "
            f"{args.local_step_scaler}, local_step_clipper {args.local_step_clipper}"
            if args.curve else f"{args.warmup} warm-up steps, then {args.rounds} round(s) of "
                               f"{args.steps} steps per peer, interleaved")
    extra = [f"model: {describe(args)}, {params / 1e6:.2f}M parameters; batch {args.batch} per "
             f"rank ({args.batch * ranks} per step); Adam lr {args.lr}"]
    if not args.curve:
        extra.append("step = forward + backward with DDP's communication (median round; min/max "
                     "over rounds); bwd+comm = that backward; bwd = backward under no_sync; comm "
                     "= one all-reduce of all gradients on the peer's path; overlap = bwd + comm "
                     "- bwd+comm")
    if not args.curve:
        extra.append("fsdp2-X-rNN: fully_shard on group X, MixedPrecisionPolicy(param_dtype="
                     "bfloat16, reduce_dtype=float32 (r32) / bfloat16 (r16)); comm = one "
                     "reduce_scatter of all gradients in the reduce dtype")
        extra.append("fsdp2-mpicomm-q8: fsdp2-mpicomm-r16 with compressed.fsdp.quantize_comms "
                     "(int8 weight all-gathers and gradient reduce-scatters, one fp32 scale per "
                     "512 elements); fsdp2-mpicomm-q1: the same with 1-bit gradients (error "
                     "feedback); their weights are checked across ranks only")
    return what, extra


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.onebit_warmup is None:
        args.onebit_warmup = max(0, args.warmup - 1)
    import torch

    import mpicomm

    torch.set_num_threads(1)
    mpi_comm = MPI.COMM_WORLD
    rep = common.Reporter(BENCH, mpi_comm, args, CURVE_COLUMNS if args.curve else COLUMNS)
    mcomm = mpicomm.init()
    teacher = build_model(args, seed=1).requires_grad_(False)
    params = models.param_count(teacher)
    what, extra = _header(args, mpi_comm.Get_size(), params)
    dtype = "float32" if args.curve else f"{args.dtype} (DDP peers); FSDP2 peers bfloat16"
    rep.start(dtype=dtype, iterations=what, extra=extra,
              meta={"model": describe(args), "params": params})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if args.curve:
            rc = curve_main(args, mpi_comm, mcomm, teacher, rep)
            _close()
            return rc
        return _steps_main(args, mpi_comm, mcomm, teacher, params, rep)


def _steps_main(args, mpi_comm, mcomm, teacher, params, rep) -> int:
    """Collective: the step program after the header: every peer's rounds, checks, records."""
    peers, rounds = _measure(args, mpi_comm, mcomm, teacher)
    wrong, notes = check_peers(peers, mpi_comm, args.dtype)
    for line in notes:
        rep.note(line)
    records = []
    for name, peer in peers.items():
        rec = _step_record(rep, args, mpi_comm, params, name, peer, rounds[name], wrong[name])
        records.append(rec)
        rep.emit(rec)
    by_name = {r["peer"]: r for r in records}
    ratios = [f"{r['peer']} {r['step_ms'] / by_name[reference_of(r['peer'])]['step_ms']:.2f}x"
              + ("" if reference_of(r["peer"]) == "gloo" else f" ({reference_of(r['peer'])}'s)")
              for r in records if reference_of(r["peer"]) in by_name
              and reference_of(r["peer"]) != r["peer"]]
    if ratios:
        rep.note("step time / gloo's (medians): " + ", ".join(ratios))
    parts = [parts_text(r) for r in records if "coll_ms" in r]
    if parts:
        rep.note("step parts per step (median round, mean over ranks; wire = collectives - "
                 "pack - unpack): " + "; ".join(parts))
    wire = [_wire_text(r, by_name) for r in records if r["wire_bytes_per_step"] is not None]
    if wire:
        rep.note("bytes on the links per rank and step (median round): " + ", ".join(wire))
    _close()
    return rep.finish("all values correct (#wrong = 0: replicas agree across ranks; exact peers "
                      f"within {tolerance('', args.dtype):g} (FSDP2 peers "
                      f"{tolerance('fsdp2-', args.dtype):g}) of their gloo twin's weights)")


def _wire_text(rec: dict, by_name: dict) -> str:
    """``peer N MiB (Rx reference's)``: one peer's bytes on the links per step (netsim)."""
    text = f"{rec['peer']} {rec['wire_bytes_per_step'] / 2**20:.2f} MiB"
    ref = by_name.get(reference_of(rec["peer"]))
    if ref is not None and ref is not rec and ref["wire_bytes_per_step"]:
        text += (f" ({rec['wire_bytes_per_step'] / ref['wire_bytes_per_step']:.2f}x "
                 f"{ref['peer']}'s)")
    return text


def _measure(args, mpi_comm, mcomm, teacher) -> tuple[dict, dict[str, list[dict]]]:
    """Collective: build the peers, warm each up, run the interleaved rounds (order rotating)."""
    import torch.distributed as dist

    groups = {"gloo": common.init_gloo(mpi_comm)}
    if any(p == "mpicomm" or p.startswith("fsdp2-mpicomm") for p in args.peers):
        groups["mpicomm"] = dist.new_group(backend="mpicomm")
    peers = {name: make_peer(name, args, groups, mcomm) for name in args.peers}
    for peer in peers.values():
        warm_up(peer, args, mpi_comm.Get_rank(), teacher)
    rounds: dict[str, list[dict]] = {name: [] for name in peers}
    order = list(peers)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            rounds[name].append(run_round(peers[name], args, mpi_comm, teacher))
    return peers, rounds


def _step_record(rep, args, mpi_comm, params: int, name: str, peer, rounds: list[dict],
                 wrong: int) -> dict:
    """Collective (the loss): the ``step`` record of one peer, from its median round."""
    times, means = common.median_round([(r["step"],) * 3 for r in rounds])
    mid = rounds[means.index(times[1])]
    loss = mpi_comm.allreduce(peer.loss, op=MPI.SUM) / mpi_comm.Get_size()
    fsdp = name in FSDP_PEERS
    grad_dtype = grad_dtype_of(name, args.dtype)
    parts = {f"{k}_ms": v * 1e3 for k, v in mid["parts"].items()} if mid.get("parts") else {}
    return dict(rep.base("step"), peer=name, model=describe(args), params=params,
                grad_bytes=int(params * {"float32": 4, "int8": 1, "1bit": 1 / 8}.get(grad_dtype, 2)),
                dtype="bfloat16" if fsdp else args.dtype, grad_dtype=grad_dtype,
                batch=args.batch, steps=args.steps, rounds=args.rounds,
                step_ms=mid["step"] * 1e3, step_ms_min=min(means) * 1e3,
                step_ms_max=max(means) * 1e3, step_ms_rounds=[m * 1e3 for m in means],
                samples_per_s=args.batch * mpi_comm.Get_size() / mid["step"], loss=loss,
                backward_ms=mid["backward"] * 1e3, comm_ms=mid["comm"] * 1e3,
                backward_comm_ms=mid["backward_comm"] * 1e3,
                overlap_ms=(mid["backward"] + mid["comm"] - mid["backward_comm"]) * 1e3,
                wrong=wrong, trained_steps=peer.step, wire_bytes_per_step=mid["wire_bytes"],
                **parts)


def _close() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

