"""Where a remembered 8-byte fast call's time goes: ``python -m bench.fastpath_cost [--calls 4000]
[--rounds 15]`` (one process, MPI at one rank).

Times this thread's CPU time (``time.thread_time``) per call, best of ``--rounds`` rounds of
``--calls`` calls, the cases alternating within each round: for all_reduce, broadcast,
all_gather_into_tensor and reduce_scatter_tensor, the Communicator's call on the same tensors
again with the remembered-call check in Python (``python``) and, when ``mpicomm.native`` is
built, in C (``native``), beside mpi4py's call on numpy arrays (``mpi4py``, the peer of ``bench
collectives``) and on the prepared ``[buffer, datatype]`` the fast path hands MPI (``mpi4py-spec``);
then each tensor property the Python check reads. At one rank MPI's own work is a copy of 8
bytes, so the differences are the per-call overheads alone: what a small collective (a loss, a
gradient norm, a flag) costs a training step on mpicomm beyond MPI itself, and where it goes.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

__all__ = ["OPS", "PROPERTIES", "measure", "main"]

OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")
PROPERTIES = {  # what the Python check reads of each tensor
    "data_ptr()": lambda t: t.data_ptr(),
    "nbytes": lambda t: t.nbytes,
    "dtype": lambda t: t.dtype,
    "is_contiguous()": lambda t: t.is_contiguous(),
    "is_cpu": lambda t: t.is_cpu,
    "is_neg()": lambda t: t.is_neg(),
}


def _best(fn: Callable[[], object], calls: int) -> float:
    """Thread CPU time per call of one batch, in microseconds."""
    t = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t) / calls * 1e6


def _cases(comm, op: str) -> tuple[dict[str, Callable[[], object]], Callable[[], bool]]:
    """The calls to time for ``op`` at one rank (8 bytes), and a check of the Communicator's
    result: at one rank every op leaves, or copies, the values it was given."""
    from mpicomm import fastpath

    c = comm.mpi_comm
    small, big = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    want = {"all_reduce": (small, [1.0, 2.0]), "broadcast": (small, [1.0, 2.0]),
            "all_gather_into_tensor": (big, [1.0, 2.0]),
            "reduce_scatter_tensor": (small, [3.0, 4.0])}[op]
    a, b = np.zeros(2, np.float32), np.zeros(2 * comm.size, np.float32)
    out = np.zeros(2, np.float32)  # mpi4py's all_reduce peer in bench collectives: out of place
    # the prepared MPI buffers of tensors of their own (kept alive by the calls' defaults)
    ts, tb = torch.zeros(2), torch.zeros(2 * comm.size)
    spec_s, spec_b, keep = fastpath._plain(ts)[0], fastpath._plain(tb)[0], (ts, tb)
    mine = {
        "all_reduce": lambda: comm.all_reduce(small),
        "broadcast": lambda: comm.broadcast(small, src=0),
        "all_gather_into_tensor": lambda: comm.all_gather_into_tensor(big, small),
        "reduce_scatter_tensor": lambda: comm.reduce_scatter_tensor(small, big),
    }[op]
    peer = {
        "all_reduce": (lambda: c.Allreduce(a, out, op=MPI.SUM),
                       lambda keep=keep: c.Allreduce(MPI.IN_PLACE, spec_s, MPI.SUM)),
        "broadcast": (lambda: c.Bcast(a, root=0), lambda keep=keep: c.Bcast(spec_s, 0)),
        "all_gather_into_tensor": (lambda: c.Allgather(a, b),
                                   lambda keep=keep: c.Allgather(spec_s, spec_b)),
        "reduce_scatter_tensor": (lambda: c.Reduce_scatter_block(b, a, op=MPI.SUM),
                                  lambda keep=keep: c.Reduce_scatter_block(spec_b, spec_s,
                                                                           MPI.SUM)),
    }[op]
    cases = {"python": mine, "mpi4py": peer[0], "mpi4py-spec": peer[1]}
    if fastpath._native is not None:
        cases["native"] = mine
    return cases, lambda: want[0].tolist() == want[1]


def _with_check(mode: str, fn: Callable[[], object]) -> Callable[[], float]:
    """``fn`` timed with the remembered-call check in Python or in C (module state restored)."""
    from mpicomm import fastpath

    def run(calls: int) -> float:
        saved = fastpath._same, fastpath._same2
        if mode == "python":
            fastpath._same = fastpath._same2 = None
        try:
            fn()  # remembered from here on
            return _best(fn, calls)
        finally:
            fastpath._same, fastpath._same2 = saved
    return run


def measure(calls: int = 4000, rounds: int = 15, comm=None) -> dict:
    """``{"calls": {op: {case: us}}, "properties": {name: ns}, "wrong": [op, ...]}``: best
    per-call thread CPU time over ``rounds`` rounds (cases alternating), property reads net of
    an empty call, the ops whose result was not the expected one after the timed calls."""
    import mpicomm

    if calls < 1 or rounds < 1:
        raise ValueError(f"fastpath_cost: expected calls >= 1 and rounds >= 1, got calls={calls} "
                         f"rounds={rounds}")
    comm = comm or mpicomm.init()
    made = {op: _cases(comm, op) for op in OPS}
    timers = {op: {case: _with_check(case, fn) for case, fn in cases.items()}
              for op, (cases, _) in made.items()}
    best = {op: {case: float("inf") for case in cases} for op, cases in timers.items()}
    t = torch.zeros(2)
    reads = {name: (lambda read=read: read(t))
             for name, read in {**PROPERTIES, "(empty call)": lambda t: None}.items()}
    read_best = {name: float("inf") for name in reads}
    for _ in range(rounds):
        for op, cases in timers.items():
            for case, run in cases.items():
                best[op][case] = min(best[op][case], run(calls))
        for name, fn in reads.items():
            read_best[name] = min(read_best[name], _best(fn, calls))
    empty = read_best.pop("(empty call)")
    return {"calls": best,
            "properties": {name: (us - empty) * 1e3 for name, us in read_best.items()},
            "wrong": [op for op, (_, right) in made.items() if not right()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fastpath_cost",
                                     description="Per-call CPU time of remembered 8-byte fast "
                                                 "calls beside mpi4py's, at one rank.")
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    if MPI.COMM_WORLD.Get_size() != 1:
        parser.error("run it as one process (it measures per-call CPU time at one rank)")
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    result = measure(args.calls, args.rounds)
    print(f"# thread CPU per 8-byte call, best of {args.rounds} x {args.calls}, load {load}, "
          f"{MPI.Get_library_version().splitlines()[0].strip()}")
    cases = ("python", "native", "mpi4py", "mpi4py-spec")
    print(f"{'op':>24}" + "".join(f"{c:>13}" for c in cases) + f"{'python-mpi4py':>15}"
          + f"{'native-mpi4py':>15}")
    for op, row in result["calls"].items():
        cells = "".join(f"{row[c]:13.3f}" if c in row else f"{'-':>13}" for c in cases)
        diffs = "".join(f"{row[c] - row['mpi4py']:+15.3f}" if c in row else f"{'-':>15}"
                        for c in ("python", "native"))
        print(f"{op:>24}{cells}{diffs}")
    print("# property reads (ns, net of an empty call): " + ", ".join(
        f"{name} {ns:.0f}" for name, ns in result["properties"].items()))
    if result["wrong"]:
        print(f"# WRONG results after the timed calls: {', '.join(result['wrong'])}")
        return 1
    print("# all results correct")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
