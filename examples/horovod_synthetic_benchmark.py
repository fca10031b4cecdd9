"""Training throughput on synthetic data with Horovod's API on mpicomm (images per second,
as Horovod's PyTorch synthetic benchmark reports it), a small convolutional network by default.

    mpiexec -n 2 python -m mpi4py examples/horovod_synthetic_benchmark.py [--num-iters 5]

For the side-by-side comparison with DDP on mpicomm and on gloo: ``python -m bench horovod``.
"""
from __future__ import annotations

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F

import mpicomm.horovod as hvd


def make_model(width: int = 32, classes: int = 100) -> torch.nn.Module:
    """A small ResNet-like stack (no torchvision needed)."""
    layers = [torch.nn.Conv2d(3, width, 3, padding=1), torch.nn.ReLU()]
    for _ in range(3):
        layers += [torch.nn.Conv2d(width, width, 3, padding=1), torch.nn.BatchNorm2d(width),
                   torch.nn.ReLU()]
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(width, classes)]
    return torch.nn.Sequential(*layers)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (its elastic variant takes them too)."""
    p.add_argument("--fp16-allreduce", action="store_true")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-batches-per-iter", type=int, default=5)
    p.add_argument("--num-iters", type=int, default=5)


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--num-warmup-batches", type=int, default=2)
    args = p.parse_args(argv)

    hvd.init()
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 100, (args.batch_size,))

    def benchmark_step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(s):
        if hvd.rank() == 0:
            print(s, flush=True)

    log(f"model: small ResNet-like, batch size {args.batch_size}, ranks {hvd.size()}")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    img_secs = []
    for x in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"iter #{x}: {img_sec:.1f} img/sec per rank")
        img_secs.append(img_sec)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    return float(mean)


if __name__ == "__main__":
    main()
