"""What a quantized FSDP2 collective adds to a call beyond the transfer: ``python -m
bench.fsdp_call_cost [--kib 64] [--ranks 2] [--calls 200] [--rounds 7]`` (one process, no MPI).

Each call of ``compressed.fsdp.QuantizedAllGather`` / ``QuantizedReduceScatter`` runs as FSDP2
makes it at ``--ranks`` ranks with ``--kib`` KiB per rank, its transfer replaced by a copy of
the same bytes; beside it, that copy alone for FSDP2's own collective (its input copied into the
output). Times are this thread's CPU time (``time.thread_time``) per call, so a loaded machine
stretches them less than wall time; reported as the minimum and median over rounds, and the
difference of the minimums is what quantizing costs each FSDP2 collective in CPU time (the
wire time of each path is not in it: int8 moves about half of bf16's bytes), so a user can weigh
it against the bytes saved: at small messages the added time can outweigh the smaller transfer.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist

from compressed.fsdp import QuantizedAllGather, QuantizedReduceScatter
from compressed.fsdp import collectives

__all__ = ["measure", "main"]


class _Group:
    """The size and rank an FSDP2 group would have (nothing else is asked of it)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


class _CopyTransfer:
    """The transfer as copies: every rank's row is this rank's (the bytes a peer would send)."""

    def __init__(self, group: "_Group") -> None:
        self.size, self.rank = group.size(), group.rank()

    @staticmethod
    def all_gather_into_tensor(recv: torch.Tensor, send: torch.Tensor) -> None:
        for row in recv.view(recv.shape[0], -1):
            row.copy_(send.view(-1))

    @staticmethod
    def all_to_all_single(recv: torch.Tensor, send: torch.Tensor) -> None:
        recv.copy_(send)


def _time(fn: Callable[[], None], calls: int) -> float:
    for _ in range(max(1, calls // 10)):
        fn()
    t = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t) / calls * 1e6


def measure(kib: int = 64, ranks: int = 2, calls: int = 200, rounds: int = 7,
            dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> list[dict]:
    """Rows ``{dtype, op, q8_us: (min, median), copy_us: (min, median), extra_us}`` (CPU time
    per call; ``extra_us``: the difference of the minimums)."""
    if ranks < 2 or kib < 1 or calls < 1 or rounds < 1:
        raise ValueError(f"fsdp_call_cost: expected ranks >= 2 and kib, calls, rounds >= 1, got "
                         f"ranks={ranks} kib={kib} calls={calls} rounds={rounds}")
    group, rows = _Group(ranks), []
    with mock.patch.object(collectives, "_communicator", lambda g, a: _CopyTransfer(g)):
        for dtype in dtypes:
            n = kib * 1024 // torch.empty((), dtype=dtype).element_size()
            x = torch.randn(n).to(dtype)
            out = torch.empty(ranks * n, dtype=dtype)
            grads = torch.randn(ranks * n).to(dtype)
            shard = torch.empty(n, dtype=dtype)
            ag, rs = QuantizedAllGather(), QuantizedReduceScatter()
            plain_out, plain_in = torch.empty(ranks * n, dtype=dtype), torch.empty(ranks * n,
                                                                                   dtype=dtype)

            def own_ag() -> None:
                for row in plain_out.view(ranks, n):
                    row.copy_(x)
            cases = {
                "all_gather": (lambda: ag(out, x, group), own_ag),
                "reduce_scatter": (lambda: rs(shard, grads, group, dist.ReduceOp.AVG),
                                   lambda: plain_in.copy_(grads)),
            }
            times: dict[tuple[str, int], list[float]] = {}
            for _ in range(rounds):  # interleaved: the load changes alike for both
                for op, fns in cases.items():
                    for i, fn in enumerate(fns):
                        times.setdefault((op, i), []).append(_time(fn, calls))
            for op in cases:
                q, c = times[(op, 0)], times[(op, 1)]
                rows.append({"dtype": str(dtype).replace("torch.", ""), "op": op,
                             "q8_us": (min(q), statistics.median(q)),
                             "copy_us": (min(c), statistics.median(c)),
                             "extra_us": min(q) - min(c)})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.fsdp_call_cost", description=__doc__)
    p.add_argument("--kib", type=int, default=64, help="KiB per rank (default 64)")
    p.add_argument("--ranks", type=int, default=2, help="group size the calls are made for")
    p.add_argument("--calls", type=int, default=200, help="calls per round")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as bench train: a copy above torch's grain size would fork
    rows = measure(args.kib, args.ranks, args.calls, args.rounds)
    print(f"# {args.kib} KiB per rank, {args.ranks} ranks, transfer replaced by a copy; "
          f"thread CPU time per call, min / median of {args.rounds} rounds of {args.calls}")
    print(f"# {'op':>14} {'dtype':>9} {'int8 (us)':>15} {'copy (us)':>15} {'extra (us)':>10}")
    for r in rows:
        print(f"  {r['op']:>14} {r['dtype']:>9} {r['q8_us'][0]:7.1f} /{r['q8_us'][1]:7.1f} "
              f"{r['copy_us'][0]:7.1f} /{r['copy_us'][1]:7.1f} {r['extra_us']:10.1f}")
    return rows


if __name__ == "__main__":
    main()
