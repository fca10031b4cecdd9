"""The replicas of ``bench train``: the model and data, DDP and FSDP2 peers, one timed round,
and the checks of their weights (``bench.train`` runs them, ``bench.train_curve`` trains on the
same model and data)."""
from __future__ import annotations

import contextlib
import time

from mpi4py import MPI

from . import models
from .train_parts import StepParts

DDP_PEERS = ("mpicomm", "gloo", "mpicomm-hook", "onebit-hook")
FSDP_PEERS = ("fsdp2-mpicomm-r32", "fsdp2-gloo-r32", "fsdp2-mpicomm-r16", "fsdp2-gloo-r16",
              "fsdp2-mpicomm-q8", "fsdp2-mpicomm-q1")
#: FSDP2 peers whose collectives quantize (compressed.fsdp): checked across ranks only
QUANTIZED = ("fsdp2-mpicomm-q8", "fsdp2-mpicomm-q1")
PEERS = DDP_PEERS + FSDP_PEERS
EXACT = ("mpicomm", "gloo", "mpicomm-hook")  # must match gloo's weights

__all__ = ["PEERS", "DDP_PEERS", "FSDP_PEERS", "QUANTIZED", "EXACT", "grad_dtype_of",
           "build_model", "describe", "batch",
           "Peer", "reference_of", "make_peer", "warm_up", "run_round", "tolerance",
           "check_peers"]


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
    """The peer whose weights ``name``'s are checked against (gloo's twin); a quantized peer's
    reference is its unquantized twin (step times compared, weights not)."""
    if name in QUANTIZED:
        return name.rsplit("-", 1)[0] + "-r16"
    return name.replace("mpicomm", "gloo") if name.startswith("fsdp2-") else "gloo"


def grad_dtype_of(name: str, ddp_dtype: str) -> str:
    """The dtype gradients travel in: FSDP2's reduce dtype, int8 or 1bit for a quantized peer."""
    if name in QUANTIZED:
        return "1bit" if name.endswith("-q1") else "int8"
    if name in FSDP_PEERS:
        return "float32" if name.endswith("-r32") else "bfloat16"
    return ddp_dtype


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _prefetch(units) -> None:
    """FSDP2's explicit prefetching: each unit's forward all-gathers the next unit's weights and
    each backward the previous unit's, as async unshards (torch's private switch for them)."""
    for i, unit in enumerate(units):
        unit._set_unshard_async_op(True)
        if i + 1 < len(units):
            unit.set_modules_to_forward_prefetch([units[i + 1]])
        if i > 0:
            unit.set_modules_to_backward_prefetch([units[i - 1]])


def make_fsdp_peer(name: str, args, groups: dict) -> Peer:
    """FSDP2 on the mpicomm or gloo group, bf16 parameters, reduce dtype float32 or bfloat16;
    ``-q8``: reduce dtype bfloat16, int8 weight all-gathers and gradient reduce-scatters;
    ``-q1``: the same with 1-bit gradient reduce-scatters (error feedback per module)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    pg = groups["mpicomm" if "-mpicomm-" in name else "gloo"]
    reduce_dtype = torch.float32 if name.endswith("-r32") else torch.bfloat16
    mesh = DeviceMesh.from_group(pg, "cpu")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    model = build_model(args, seed=0)
    units = [layer for layer in model if any(True for _ in layer.parameters())]
    for layer in units:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if getattr(args, "fsdp_prefetch", False):
        _prefetch(units)
    numel = sum(p.numel() for p in build_model(args, seed=0).parameters())
    n = pg.size()
    flat = torch.zeros(-(-numel // n) * n, dtype=reduce_dtype)
    out = torch.zeros(flat.numel() // n, dtype=reduce_dtype)
    if name in QUANTIZED:
        from compressed.fsdp import QuantizedReduceScatter, quantize_comms

        bits = 1 if name.endswith("-q1") else 8
        quantize_comms(model, weight_bits=8, grad_bits=bits,  # timed rounds: 1-bit from the start
                       warmup_steps=None if getattr(args, "curve", False) else 0)
        scatter = QuantizedReduceScatter(bits=bits)

        def comm_alone():
            flat.zero_()
            scatter(out, flat, pg, dist.ReduceOp.AVG)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        return Peer(name, model, opt, comm_alone, flat, no_sync=lambda: _fsdp_no_sync(model))

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


def warm_up(peer: Peer, args, rank: int, teacher) -> None:
    """``--warmup`` untimed steps, then (after any) one backward alone and one communication alone."""
    for _ in range(args.warmup):
        _train_step(peer, args, rank, teacher)
    if args.warmup:
        _backward_alone(peer, args, rank, teacher)
        peer.comm_alone()


def _mean(mpi_comm, values: list[float]) -> float:
    """Collective: the mean over ranks of this rank's mean."""
    local = sum(values) / max(1, len(values))
    return mpi_comm.allreduce(local, op=MPI.SUM) / mpi_comm.Get_size()


def run_round(peer: Peer, args, mpi_comm, teacher) -> dict:
    """Collective: one round of ``peer``: steps, backward alone, communication alone (seconds),
    under netsim the bytes one rank put on the links per step (else None), and with ``--parts``
    the steps' parts (``bench.train_parts``; else None)."""
    from .netsim import LinkMeter

    rank = mpi_comm.Get_rank()
    meter = LinkMeter(mpi_comm)  # bytes on the simulated links (under netsim only)
    parts = StepParts() if getattr(args, "parts", False) else None
    mpi_comm.Barrier()
    meter.start()
    with parts.active() if parts is not None else contextlib.nullcontext():
        steps = [_train_step(peer, args, rank, teacher) for _ in range(args.steps)]
    wire = meter.stop(args.steps)
    mpi_comm.Barrier()
    alone = [_backward_alone(peer, args, rank, teacher) for _ in range(args.steps)]
    mpi_comm.Barrier()
    comm = []
    for _ in range(args.steps):
        t = time.perf_counter()
        peer.comm_alone()
        comm.append(time.perf_counter() - t)
    per_step = None if parts is None else parts.per_step(sum(s[0] for s in steps) / len(steps),
                                                         args.steps)
    return {"step": _mean(mpi_comm, [s[0] for s in steps]),
            "backward_comm": _mean(mpi_comm, [s[1] for s in steps]),
            "backward": _mean(mpi_comm, alone), "comm": _mean(mpi_comm, comm),
            "wire_bytes": wire,
            "parts": None if per_step is None else {k: _mean(mpi_comm, [v])
                                                    for k, v in sorted(per_step.items())}}


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
        if (name in EXACT or name in FSDP_PEERS) and name not in QUANTIZED \
                and reference_of(name) not in peers:
            notes.append(f"{reference_of(name)} not run: {name}'s weights are checked across "
                         "ranks only")
    for name, peer in peers.items():
        w = weights[name]
        first = np.empty_like(w)
        first[:] = w
        mpi_comm.Bcast(first, root=0)
        bad = int(np.count_nonzero(w != first)) + int(not np.isfinite(peer.loss))
        ref = weights.get(reference_of(name))
        if ref is not None and (name in EXACT or name in FSDP_PEERS) and name not in QUANTIZED:
            bad += int(np.count_nonzero(np.abs(w - ref) > tolerance(name, dtype)))
        wrong[name] = mpi_comm.allreduce(bad, op=MPI.SUM)
    return wrong, notes
