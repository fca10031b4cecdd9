"""What the programs start beside MPI: the torch.distributed gloo group, free ports, a clean environment."""
from __future__ import annotations

import socket

from mpi4py import MPI

import mpicomm

__all__ = ["clean_env", "free_port", "init_gloo"]


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
