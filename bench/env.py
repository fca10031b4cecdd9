"""What the programs run on and start beside MPI: the environment they report, the
torch.distributed gloo group, free ports, a clean environment for child processes."""
from __future__ import annotations

import os
import socket
import time

from mpi4py import MPI

import mpicomm
from accelerators.mpi_lib import library_version

__all__ = ["environment_info", "clean_env", "free_port", "init_gloo"]


def environment_info(mpi_comm: MPI.Comm) -> dict:
    """Collective: MPI vendor and versions, ranks, hosts; the same dict on every rank."""
    import mpi4py

    names = mpi_comm.allgather(MPI.Get_processor_name())
    hosts = sorted(set(names))
    vendor, vver = MPI.get_vendor()
    info = {
        "mpi_vendor": vendor,
        "mpi_version": ".".join(map(str, vver)),
        "mpi_library": library_version().splitlines()[0].strip(),
        "mpi4py_version": mpi4py.__version__,
        "ranks": mpi_comm.Get_size(),
        "hosts": len(hosts),
        "host_names": hosts,
        "network": os.environ.get("MPICOMM_BENCH_NETWORK", "local"),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import numpy
        info["numpy_version"] = numpy.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        import torch
        info["torch_version"] = torch.__version__
    except ImportError:  # pragma: no cover
        info["torch_version"] = None
    return mpi_comm.bcast(info, root=0)


def clean_env() -> dict:
    """This process's environment without the MPI launcher's variables (for a fresh launch)."""
    return mpicomm.clean_env()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(mpi_comm: MPI.Comm, timeout_s: float = 60.0):
    """Collective: join the torch.distributed gloo group of these ranks (once); return the group.

    Rank 0 picks the rendezvous address (its own host's address on several hosts, 127.0.0.1 on
    one) and broadcasts it with MPI.
    """
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return dist.group.WORLD
    addr = None
    if mpi_comm.Get_rank() == 0:
        hosts = set(mpi_comm.gather(MPI.Get_processor_name(), root=0))
        host = "127.0.0.1"
        if len(hosts) > 1:
            host = socket.gethostbyname(socket.gethostname())
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            addr = (host, s.getsockname()[1])
    else:
        mpi_comm.gather(MPI.Get_processor_name(), root=0)
    host, port = mpi_comm.bcast(addr, root=0)
    dist.init_process_group("gloo", rank=mpi_comm.Get_rank(), world_size=mpi_comm.Get_size(),
                            init_method=f"tcp://{host}:{port}",
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist.group.WORLD
