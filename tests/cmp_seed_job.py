"""The shape of DeepSpeed's compressed-backend test script, on ``compressed.CompressedBackend``.

Run under ``mpiexec -n P python tests/cmp_seed_job.py mpicomm|gloo``: a plain
``dist.init_process_group``, a float64 simulation of the 1-bit allreduce on ``dist.all_reduce``,
one ``CompressedBackend().compressed_allreduce`` on the same input, and a per-position check that
excuses only positions whose compensated server value is tiny. Exits 1 on any failing position.
"""
from __future__ import annotations

import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import compressed
import mpicomm  # noqa: F401  (registers the "mpicomm" backend)

THRESHOLD = 1e-6


def sgn(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


def simulate(a: torch.Tensor, size: int, rank: int, N: int):
    """(output, worker error, server error, compensated server values) in float64."""
    x = torch.zeros(N, dtype=torch.float64)
    x[: a.numel()] = a.double()
    scale = x.norm() / np.sqrt(N)
    cx = scale * sgn(x)
    worker_error = x - cx
    dist.all_reduce(cx)
    cx /= size
    chunks = cx.view(size, -1)
    sscale = chunks.norm(dim=1, keepdim=True) / np.sqrt(chunks.shape[1])
    out = (sscale * sgn(chunks)).reshape(-1)
    server_error = chunks[rank] - sscale[rank] * sgn(chunks[rank])
    return out, worker_error, server_error, chunks[rank]


def main() -> int:
    kind = sys.argv[1]
    world = MPI.COMM_WORLD
    if kind == "gloo":
        port = None
        if world.rank == 0:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = world.bcast(port, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank,
                                world_size=world.size, timeout=timedelta(seconds=120))
    else:
        dist.init_process_group(kind, timeout=timedelta(seconds=120))
    size, rank = dist.get_world_size(), dist.get_rank()
    backend = compressed.CompressedBackend()
    n = 8 * size * 4096 + 5                       # not a multiple of 8 * size: padded
    N = compressed.padded_size(n, size)
    gen = torch.Generator().manual_seed(rank)
    a = (torch.rand(n, generator=gen) - 0.5) + 0.01 * rank
    worker_error, server_error = torch.zeros(N), torch.zeros(N // size)
    ref, ref_we, ref_se, compensated = simulate(a, size, rank, N)
    out = backend.compressed_allreduce(a.clone(), worker_error, server_error, 0)
    chunk = N // size
    lo, hi = rank * chunk, min((rank + 1) * chunk, n)
    diff = (out[lo:hi].double() - ref[lo:hi]).abs() > THRESHOLD
    bad = int((diff & (compensated[: hi - lo].abs() > THRESHOLD)).sum())
    bad += int(((worker_error.double() - ref_we).abs() > THRESHOLD).sum())
    tiny = compensated.abs() <= THRESHOLD
    bad += int((((server_error.double() - ref_se).abs() > THRESHOLD) & ~tiny).sum())
    bad_everywhere = world.allreduce(bad, op=MPI.SUM)
    print(f"rank {rank} of {size} on {kind}: {bad} failing positions "
          f"({'ok' if bad == 0 else 'FAILED'})", flush=True)
    dist.destroy_process_group()
    return 1 if bad_everywhere else 0


if __name__ == "__main__":
    sys.exit(main())
