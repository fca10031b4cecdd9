"""Horovod's synthetic benchmark on mpicomm: images per second of mpicomm.horovod's
DistributedOptimizer beside DDP on the mpicomm backend and DDP on gloo, in one run.

    mpiexec -n 2 python -m mpi4py -m bench horovod [--batch-size 32] [--rounds 5] [--steps 5]

Every peer trains the same model from the same weights on the same synthetic batches (SGD);
rounds interleave the peers (one round: ``--steps`` timed steps of each), and each peer's step
time is the median over rounds of its mean step time (slowest rank). Prints img/s per peer, the
step-time ratio of each peer to DDP on mpicomm, and the largest weight difference to it at the
end (the peers must train alike).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from mpi4py import MPI

PEERS = ("horovod", "ddp-mpicomm", "ddp-gloo")


def build_model(kind: str, width: int):
    import torch

    torch.manual_seed(0)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, width),
                                   torch.nn.ReLU(), torch.nn.Linear(width, width),
                                   torch.nn.ReLU(), torch.nn.Linear(width, 100))
    layers = [torch.nn.Conv2d(3, width, 3, padding=1), torch.nn.ReLU()]
    for _ in range(4):
        layers += [torch.nn.Conv2d(width, width, 3, padding=1), torch.nn.ReLU()]
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(width, 100)]
    return torch.nn.Sequential(*layers)


def make_peer(name: str, args, groups):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import mpicomm.horovod as hvd

    model = build_model(args.model, args.width)
    if name == "horovod":
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                       named_parameters=model.named_parameters())
        return model, opt
    ddp = DDP(model, process_group=groups[name.split("-")[1]], bucket_cap_mb=args.bucket_mb)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=args.lr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
    p.add_argument("--width", type=int, default=64, help="channels (cnn) or hidden size (mlp)")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="timed steps per peer per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="DDP's bucket_cap_mb; mpicomm.horovod's buckets follow "
                        "HOROVOD_FUSION_THRESHOLD (bytes, default 25 MiB)")
    p.add_argument("--peers", default=",".join(PEERS))
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import mpicomm.horovod as hvd
    from bench.env import init_gloo

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    hvd.init()
    groups = {"gloo": init_gloo(comm)}
    groups["mpicomm"] = dist.new_group(backend="mpicomm")
    names = args.peers.split(",")
    peers = {n: make_peer(n, args, groups) for n in names}
    g = torch.Generator().manual_seed(100 + rank)
    data = torch.randn(args.batch_size, 3, 32, 32, generator=g)
    target = torch.randint(0, 100, (args.batch_size,), generator=g)

    def step(model, opt):
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    for model, opt in peers.values():
        for _ in range(args.warmup):
            step(model, opt)
    times = {n: [] for n in names}
    for _ in range(args.rounds):
        for n in names:
            model, opt = peers[n]
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(model, opt)
            elapsed = (time.perf_counter() - t0) / args.steps
            times[n].append(comm.allreduce(elapsed, op=MPI.MAX))
    params = sum(q.numel() for q in peers[names[0]][0].parameters())
    ref = "ddp-mpicomm" if "ddp-mpicomm" in names else names[0]
    ref_w = torch.cat([q.detach().reshape(-1) for q in peers[ref][0].parameters()])
    if rank == 0:
        print(f"bench horovod: {args.model} ({params / 1e6:.2f}M parameters), {size} ranks, "
              f"batch {args.batch_size} per rank, {args.rounds} rounds x {args.steps} steps, "
              "SGD; step time = median over rounds of the slowest rank's mean")
        print(f"{'peer':<14}{'step ms':>10}{'img/s (all ranks)':>20}{'vs ' + ref:>18}"
              f"{'max |w - ' + ref + '|':>26}")
    for n in names:
        med = statistics.median(times[n])
        w = torch.cat([q.detach().reshape(-1) for q in peers[n][0].parameters()])
        diff = float((w - ref_w).abs().max())
        if rank == 0:
            ratio = med / statistics.median(times[ref])
            print(f"{n:<14}{med * 1e3:>10.2f}{args.batch_size * size / med:>20.1f}"
                  f"{ratio:>17.3f}x{diff:>26.2e}", flush=True)
    hvd.shutdown()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
