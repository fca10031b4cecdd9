"""The synthetic benchmark as an elastic job (hvd.elastic on mpicomm's elastic package): the
state is committed every batch; under ``mpirun --with-ft ulfm`` (Open MPI) a lost rank is
survived in place and training goes on from the last commit on the survivors.

    mpirun --with-ft ulfm -n 3 python -m mpi4py examples/horovod_elastic_synthetic_benchmark.py
    mpiexec -n 2 python -m mpi4py examples/horovod_elastic_synthetic_benchmark.py   # no failures
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import mpicomm.horovod as hvd
from horovod_synthetic_benchmark import add_arguments, make_model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)  # the synthetic benchmark's options, shorter runs by default
    p.set_defaults(num_iters=4, num_batches_per_iter=3)
    p.add_argument("--num-batches-per-commit", type=int, default=1)
    args = p.parse_args(argv)

    hvd.init()
    torch.manual_seed(0)
    model = make_model()
    lr_scaler = hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 100, (args.batch_size,))

    def on_state_reset():
        # the learning rate follows the number of ranks left (or added)
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * hvd.size()

    state = hvd.elastic.TorchState(model, optimizer, batch=0, iteration=0)
    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run
    def run_benchmark(state):
        while state.iteration < args.num_iters:
            t0 = time.perf_counter()
            for _ in range(state.batch, args.num_batches_per_iter):
                optimizer.zero_grad()
                F.cross_entropy(model(data), target).backward()
                optimizer.step()
                state.batch += 1
                if state.batch % args.num_batches_per_commit == 0:
                    state.commit()
            rate = args.batch_size * args.num_batches_per_iter / (time.perf_counter() - t0)
            if hvd.rank() == 0:
                print(f"iter #{state.iteration}: {rate:.1f} img/sec per rank on {hvd.size()} "
                      "rank(s)", flush=True)
            state.batch = 0
            state.iteration += 1
            state.commit()

    run_benchmark(state)
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    same = all(torch.equal(flat, other) for other in hvd.allgather_object(flat))
    if hvd.rank() == 0:
        print(f"done: {state.iteration} iterations, weights equal on all {hvd.size()} ranks: {same}",
              flush=True)
    if not same:
        raise SystemExit("the ranks' weights differ")


if __name__ == "__main__":
    main()
