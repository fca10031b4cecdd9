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
  (r16))``: bf16 compute, gradients reduce-scattered in the reduce dtype.

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
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings

from mpi4py import MPI

from . import common, models

DDP_PEERS = ("mpicomm", "gloo", "mpicomm-hook", "onebit-hook")
FSDP_PEERS = ("fsdp2-mpicomm-r32", "fsdp2-gloo-r32", "fsdp2-mpicomm-r16", "fsdp2-gloo-r16")
PEERS = DDP_PEERS + FSDP_PEERS
EXACT = ("mpicomm", "gloo", "mpicomm-hook")  # must match gloo's weights
DTYPES = ("float32", "bfloat16")
BENCH = "train"

__all__ = ["PEERS", "DDP_PEERS", "FSDP_PEERS", "DTYPES", "reference_of", "build_model", "batch", "Peer", "make_peer", "run_round", "main"]


# ---------------------------------------------------------------------------------------------
# model and data

def build_model(args, seed: int):
    """The benchmark's model: an MLP (GELU between layers) or a stack of transformer blocks."""
    if args.model == "mlp":
        return models.mlp(args.hidden, args.layers, activation="gelu", last_activation=False,
                          seed=seed)
    return models.transformer(args.hidden, args.layers, args.heads, seed=seed)


def describe(args) -> str:
    if args.model == "mlp":
        return f"mlp {args.layers} x Linear({args.hidden}, {args.hidden})"
    return (f"transformer {args.layers} x block(d={args.hidden}, heads={args.heads}, "
            f"ffn={4 * args.hidden}), seq {args.seq}")


def batch(args, rank: int, step: int, teacher):
    """Rank ``rank``'s batch of step ``step``: random inputs, targets from a fixed teacher model."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * (rank + 1) + step)
    shape = (args.batch, args.hidden) if args.model == "mlp" else (args.batch, args.seq,
                                                                    args.hidden)
    x = torch.randn(shape, generator=g)
    with torch.no_grad():
        y = teacher(x)
    return x, y


# ---------------------------------------------------------------------------------------------
# peers

class Peer:
    """One replica (DDP or FSDP2): model, optimizer, step counter, communication-alone call."""

    def __init__(self, name, ddp, opt, comm_alone, flat, no_sync=None, dtype=None) -> None:
        import torch

        self.name, self.ddp, self.opt = name, ddp, opt
        self.comm_alone = comm_alone     # fn(): one all-reduce (FSDP2: reduce-scatter) of ``flat``
        self.flat = flat
        self.no_sync = no_sync or ddp.no_sync  # context: backward without communication
        self.dtype = dtype or torch.float32   # the dtype inputs are fed in
        self.model = getattr(ddp, "module", ddp)  # the module whose weights are checked
        self.step = 0
        self.loss = float("nan")


def reference_of(name: str) -> str:
    """The peer whose weights ``name``'s are checked against (gloo's twin)."""
    return name.replace("mpicomm", "gloo") if name.startswith("fsdp2-") else "gloo"


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def make_fsdp_peer(name: str, args, groups: dict) -> Peer:
    """FSDP2 on the mpicomm or gloo group, bf16 parameters, reduce dtype float32 or bfloat16."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    pg = groups["mpicomm" if "-mpicomm-" in name else "gloo"]
    reduce_dtype = torch.float32 if name.endswith("-r32") else torch.bfloat16
    mesh = DeviceMesh.from_group(pg, "cpu")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    model = build_model(args, seed=0)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    numel = sum(p.numel() for p in build_model(args, seed=0).parameters())
    n = pg.size()
    flat = torch.zeros(-(-numel // n) * n, dtype=reduce_dtype)
    out = torch.zeros(flat.numel() // n, dtype=reduce_dtype)

    def comm_alone():
        flat.zero_()
        dist.reduce_scatter_tensor(out, flat, group=pg)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    return Peer(name, model, opt, comm_alone, flat, no_sync=lambda: _fsdp_no_sync(model))


def make_peer(name: str, args, groups: dict, mcomm) -> Peer:
    """Build ``name``'s DDP replica (same initial weights on every peer and rank)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import mpicomm.distributed

    if name in FSDP_PEERS:
        return make_fsdp_peer(name, args, groups)
    dtype = getattr(torch, args.dtype)
    model = build_model(args, seed=0).to(dtype)
    numel = sum(p.numel() for p in model.parameters())
    flat = torch.zeros(numel, dtype=dtype)
    pg = groups["mpicomm"] if name == "mpicomm" else groups["gloo"]
    ddp = DDP(model, process_group=pg, bucket_cap_mb=args.bucket_mb)
    if name in ("mpicomm", "gloo"):
        def comm_alone():
            flat.zero_()
            dist.all_reduce(flat, group=pg)
    elif name == "mpicomm-hook":
        ddp.register_comm_hook(mcomm, mpicomm.distributed.allreduce_ddp_hook)

        def comm_alone():
            flat.zero_()
            mcomm.all_reduce(flat, op="avg")
    elif name == "onebit-hook":
        import compressed

        state = compressed.OnebitDDPState(mcomm, warmup_steps=args.onebit_warmup,
                                          min_bucket_numel=args.onebit_min_bucket)
        ddp.register_comm_hook(state, compressed.onebit_ddp_hook)
        alone = compressed.OnebitAllreduce(mcomm)

        def comm_alone():
            flat.normal_()
            alone(flat, key="alone")
    else:
        raise ValueError(f"unknown peer {name!r}; expected one of {', '.join(PEERS)}")
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    return Peer(name, ddp, opt, comm_alone, flat, dtype=dtype)


def _train_step(peer: Peer, args, rank: int, teacher) -> tuple[float, float]:
    """One step; seconds of forward + backward (with DDP's communication), and of the backward."""
    import torch

    x, y = batch(args, rank, peer.step, teacher)
    peer.opt.zero_grad(set_to_none=False)
    t0 = time.perf_counter()
    loss = torch.nn.functional.mse_loss(peer.ddp(x.to(peer.dtype)).float(), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    peer.opt.step()
    peer.step += 1
    peer.loss = float(loss.detach())
    return t2 - t0, t2 - t1


def _backward_alone(peer: Peer, args, rank: int, teacher) -> float:
    """Seconds of one backward under ``no_sync`` (no communication; weights unchanged)."""
    import torch

    x, y = batch(args, rank, 10_000_000 + peer.step, teacher)
    peer.opt.zero_grad(set_to_none=False)
    with peer.no_sync():
        loss = torch.nn.functional.mse_loss(peer.ddp(x.to(peer.dtype)).float(), y)
        t0 = time.perf_counter()
        loss.backward()
        dt = time.perf_counter() - t0
    peer.opt.zero_grad(set_to_none=False)
    return dt


def _mean(mpi_comm, values: list[float]) -> float:
    """Collective: the mean over ranks of this rank's mean."""
    local = sum(values) / max(1, len(values))
    return mpi_comm.allreduce(local, op=MPI.SUM) / mpi_comm.Get_size()


def run_round(peer: Peer, args, mpi_comm, teacher) -> dict:
    """Collective: one round of ``peer``: steps, backward alone, communication alone (seconds)."""
    rank = mpi_comm.Get_rank()
    mpi_comm.Barrier()
    steps = [_train_step(peer, args, rank, teacher) for _ in range(args.steps)]
    mpi_comm.Barrier()
    alone = [_backward_alone(peer, args, rank, teacher) for _ in range(args.steps)]
    mpi_comm.Barrier()
    comm = []
    for _ in range(args.steps):
        t = time.perf_counter()
        peer.comm_alone()
        comm.append(time.perf_counter() - t)
    return {"step": _mean(mpi_comm, [s[0] for s in steps]),
            "backward_comm": _mean(mpi_comm, [s[1] for s in steps]),
            "backward": _mean(mpi_comm, alone), "comm": _mean(mpi_comm, comm)}


# ---------------------------------------------------------------------------------------------
# checks

def _weights(peer: Peer):
    """The full float32 weights (FSDP2: gathered, a collective over the peer's group)."""
    import torch

    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
                      .reshape(-1) for p in peer.model.parameters()])


def tolerance(name: str, dtype: str) -> float:
    """How far an exact peer's weights may be from its reference's: 1e-4 in float32; bf16
    compute (FSDP2 peers, --dtype bfloat16) rounds differently wherever a reduction's bits
    differ (gloo rounds 16-bit sums at every step), so 2e-2 there."""
    return 2e-2 if name.startswith("fsdp2-") or dtype != "float32" else 1e-4


def check_peers(peers: dict, mpi_comm, dtype: str = "float32") -> tuple[dict, list[str]]:
    """Collective: wrong values per peer: weights that differ between ranks (every peer), and,
    for the exact peers (DDP: mpicomm, gloo, mpicomm-hook; every FSDP2 peer), weights further
    than :func:`tolerance` from their reference's (gloo's twin); and a non-finite loss."""
    import numpy as np

    wrong, notes = {}, []
    weights = {name: _weights(peer).numpy() for name, peer in peers.items()}
    for name in peers:
        if (name in EXACT or name in FSDP_PEERS) and reference_of(name) not in peers:
            notes.append(f"{reference_of(name)} not run: {name}'s weights are checked across "
                         "ranks only")
    for name, peer in peers.items():
        w = weights[name]
        first = np.empty_like(w)
        first[:] = w
        mpi_comm.Bcast(first, root=0)
        bad = int(np.count_nonzero(w != first)) + int(not np.isfinite(peer.loss))
        ref = weights.get(reference_of(name))
        if ref is not None and (name in EXACT or name in FSDP_PEERS):
            bad += int(np.count_nonzero(np.abs(w - ref) > tolerance(name, dtype)))
        wrong[name] = mpi_comm.allreduce(bad, op=MPI.SUM)
    return wrong, notes


# ---------------------------------------------------------------------------------------------
# loss curves: the 1-bit optimizers against their exact references

CURVES = ("adam", "onebit-adam", "zero-one-adam", "lamb", "onebit-lamb")


class Lamb:
    """Plain LAMB (torch has none) as ``compressed.OnebitLamb``'s warm-up runs it: no bias
    correction, weight decay inside the trust ratio, the ratio clamped to [min_coeff, max_coeff]."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01) -> None:
        import torch

        self.params = list(params)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.max_coeff, self.min_coeff = max_coeff, min_coeff
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        import torch

        b1, b2 = self.betas
        with torch.no_grad():
            for p, m, v in zip(self.params, self.m, self.v):
                if p.grad is None:
                    continue
                m.lerp_(p.grad, 1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                u = m / (v.sqrt() + self.eps) + self.wd * p
                wn, un = float(p.norm()), float(u.norm())
                c = 1.0 if wn == 0 or un == 0 else min(max(wn / un, self.min_coeff), self.max_coeff)
                p.sub_(u, alpha=self.lr * c)


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
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if name in ("adam", "lamb") and n > 1:
                average_grads(model, run["comm"])
            opt.step()
            run["times"].append(time.perf_counter() - t0)
            run["losses"].append(mpi_comm.allreduce(float(loss.detach()), op=MPI.SUM) / n)
    out = {}
    for name, run in runs.items():
        out[name] = {"losses": run["losses"],
                     "bytes_per_step": run["comm"].sent / args.curve_steps,
                     "step_ms": mpi_comm.allreduce(sum(run["times"]) / len(run["times"]), op=MPI.MAX) * 1e3}
        run["comm"].free()
    return out


def _human_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return f"{b:.1f} GiB"


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
    p.add_argument("--onebit-warmup", type=_count(0), default=None,
                   help="steps the 1-bit hook averages exactly (default: --warmup - 1, so the "
                        "last warm-up step and every timed step are compressed)")
    p.add_argument("--onebit-min-bucket", type=_count(0), default=0,
                   help="buckets under this many elements go uncompressed (default 0)")
    p.add_argument("--curve", action="store_true",
                   help="instead: loss against step for Adam, OnebitAdam, ZeroOneAdam, LAMB, OnebitLamb")
    p.add_argument("--curve-steps", type=_count(1), default=100, help="steps of --curve (100)")
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


CURVE_COLUMNS = (common.Column("step", "step", 7, "d"),) + tuple(
    common.Column(name, name, 14, ".6f") for name in CURVES)
SUMMARY_COLUMNS = (
    common.Column("peer", "optimizer", 14),
    common.Column("final_loss", "final loss", 12, ".6f"),
    common.Column("bytes_per_step", "bytes/step", 12, ".0f"),
    common.Column("step_ms", "step(ms)", 9, ".2f"),
)


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
            return _curve_main(args, mpi_comm, mcomm, teacher, rep)
        return _steps_main(args, mpi_comm, mcomm, teacher, params, rep)


def _steps_main(args, mpi_comm, mcomm, teacher, params, rep) -> int:
    import torch.distributed as dist

    groups = {"gloo": common.init_gloo(mpi_comm)}
    if any(p == "mpicomm" or p.startswith("fsdp2-mpicomm") for p in args.peers):
        groups["mpicomm"] = dist.new_group(backend="mpicomm")
    peers = {name: make_peer(name, args, groups, mcomm) for name in args.peers}
    for peer in peers.values():
        for _ in range(args.warmup):
            _train_step(peer, args, mpi_comm.Get_rank(), teacher)
        if args.warmup:
            _backward_alone(peer, args, mpi_comm.Get_rank(), teacher)
            peer.comm_alone()
    rounds: dict[str, list[dict]] = {name: [] for name in peers}
    order = list(peers)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            rounds[name].append(run_round(peers[name], args, mpi_comm, teacher))
    wrong, notes = check_peers(peers, mpi_comm, args.dtype)
    for line in notes:
        rep.note(line)
    records = []
    for name, peer in peers.items():
        times, means = common.median_round([(r["step"],) * 3 for r in rounds[name]])
        mid = rounds[name][means.index(times[1])]
        loss = mpi_comm.allreduce(peer.loss, op=MPI.SUM) / mpi_comm.Get_size()
        fsdp = name in FSDP_PEERS
        grad_dtype = (("float32" if name.endswith("-r32") else "bfloat16") if fsdp
                      else args.dtype)
        rec = dict(rep.base("step"), peer=name, model=describe(args), params=params,
                   grad_bytes=params * (4 if grad_dtype == "float32" else 2),
                   dtype="bfloat16" if fsdp else args.dtype, grad_dtype=grad_dtype,
                   batch=args.batch, steps=args.steps, rounds=args.rounds,
                   step_ms=mid["step"] * 1e3, step_ms_min=min(means) * 1e3,
                   step_ms_max=max(means) * 1e3, step_ms_rounds=[m * 1e3 for m in means],
                   samples_per_s=args.batch * mpi_comm.Get_size() / mid["step"], loss=loss,
                   backward_ms=mid["backward"] * 1e3, comm_ms=mid["comm"] * 1e3,
                   backward_comm_ms=mid["backward_comm"] * 1e3,
                   overlap_ms=(mid["backward"] + mid["comm"] - mid["backward_comm"]) * 1e3,
                   wrong=wrong[name], trained_steps=peer.step)
        records.append(rec)
        rep.emit(rec)
    by_name = {r["peer"]: r for r in records}
    ratios = [f"{r['peer']} {r['step_ms'] / by_name[reference_of(r['peer'])]['step_ms']:.2f}x"
              + ("" if reference_of(r["peer"]) == "gloo" else f" ({reference_of(r['peer'])}'s)")
              for r in records if reference_of(r["peer"]) in by_name
              and reference_of(r["peer"]) != r["peer"]]
    if ratios:
        rep.note("step time / gloo's (medians): " + ", ".join(ratios))
    _close()
    return rep.finish("all values correct (#wrong = 0: replicas agree across ranks; exact peers "
                      f"within {tolerance('', args.dtype):g} (FSDP2 peers "
                      f"{tolerance('fsdp2-', args.dtype):g}) of their gloo twin's weights)")


def _curve_main(args, mpi_comm, mcomm, teacher, rep) -> int:
    import numpy as np

    curves = run_curve(args, mpi_comm, mcomm, teacher)
    records = []
    for name, c in curves.items():
        series = c["losses"]
        bad = int(not np.all(np.isfinite(series)))
        compressed_from = args.freeze_step if name in ("onebit-adam", "onebit-lamb") else None
        records.append(dict(rep.base("curve"), peer=name, model=describe(args), steps=len(series),
                            losses=series, final_loss=series[-1], freeze_step=compressed_from,
                            bytes_per_step=c["bytes_per_step"], step_ms=c["step_ms"],
                            label=f"{name} ({_human_bytes(c['bytes_per_step'])}/step)", wrong=bad))
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
    return rep.finish("all losses finite (#wrong = 0)",
                      title=f"{describe(args)}, {mpi_comm.Get_size()} ranks: exact and 1-bit optimizers")




def _close() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
