"""Entry point: python -m bench <program> [args]."""
from __future__ import annotations

import importlib
import sys

# program name -> (module, one-line description); each module has main(argv) -> int
PROGRAMS = {
    "demo": ("bench.demo", "the main job: a short showcase (collectives, compression, network)"),
    "collectives": ("bench.collectives", "collectives vs raw mpi4py and gloo, OSU/nccl-tests style"),
    "compressed": ("bench.compressed", "1-bit compressed allreduce vs fp32 allreduce"),
    "ckpt": ("bench.ckpt", "sharded checkpoint save/load (O_DIRECT or MPI-IO)"),
    "train": ("bench.train", "data-parallel training: DDP on mpicomm, gloo, mpicomm and 1-bit hooks"),
    "plot": ("bench.plot", "draw saved JSON runs: log-log, one panel per op, min-max bands"),
    "onebit_warmup": ("bench.onebit_warmup", "FSDP2 1-bit gradients: the loss with and without a warm-up"),
    "zero": ("bench.zero", "ZeroOptimizer vs DDP and FSDP2: step time, overlap, memory, bytes per step"),
    "horovod": ("bench.horovod", "mpicomm.horovod's DistributedOptimizer vs DDP on mpicomm and gloo (img/s)"),
    "elastic": ("bench.elastic", "a rank killed mid-training: detection, recovery, commit cost, replica memory"),
    "netsim": ("bench.netsim", "run a benchmark on simulated hosts with a rate-limited network"),
}

#: Programs that start no MPI in this process (netsim launches jobs; plot reads files).
NO_MPI = ("netsim", "plot")


def usage() -> str:
    lines = ["usage: python -m bench PROGRAM [args]   (under mpiexec, except netsim)", "",
             "programs:"]
    lines += [f"  {name:<12} {desc}" for name, (_, desc) in PROGRAMS.items()]
    lines += ["", "python -m bench PROGRAM --help shows a program's arguments"]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in PROGRAMS:
        print(f"bench: unknown program {name!r}; expected one of: {', '.join(PROGRAMS)}",
              file=sys.stderr)
        return 2
    if name not in NO_MPI:   # mpicomm's Open MPI defaults apply only if it comes before MPI starts
        import mpicomm  # noqa: F401
    module = importlib.import_module(PROGRAMS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
