"""Rank, world size and one TCPStore for all ranks, from MPI instead of launcher variables.

``import mpicomm`` wraps torch's ``env://`` rendezvous (the one ``dist.init_process_group()``
uses when given no ``init_method`` or ``store``): when the launcher did not set ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, rank and world size come from
``MPI.COMM_WORLD`` and rank 0 hosts a TCPStore whose address travels to the other ranks over MPI.
When all four are set (torchrun, or a user who set them), torch's own handler runs unchanged;
so it does under torchrun when an MPI launcher did not start the process.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
from urllib.parse import urlparse

from mpi4py import MPI

# Variables an MPI launcher (Hydra, Open MPI, PMIx, Slurm) sets in every process it starts.
_MPI_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID",
                      "MPI_LOCALRANKID", "HYDI_CONTROL_FD")
# Variables only torchrun's elastic agent sets in its workers (LocalElasticAgent._start_workers
# in torch/distributed/elastic/agent/server/local_elastic_agent.py). Not LOCAL_WORLD_SIZE,
# GROUP_RANK or LOCAL_RANK: other launchers set those too (Hugging Face accelerate sets
# LOCAL_WORLD_SIZE under mpiexec).
_TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                  "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")
_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """Whether this process looks started by torchrun (its elastic agent's variables present)."""
    return any(v in os.environ for v in _TORCHRUN_VARS)


def under_mpi_launcher() -> bool:
    """Whether an MPI launcher started this process (more than one MPI rank, or its variables)."""
    return MPI.COMM_WORLD.Get_size() > 1 or any(v in os.environ for v in _MPI_LAUNCHER_VARS)


def launcher_hint(world_size: int) -> str:
    """What to run instead of torchrun for a job of ``world_size`` ranks."""
    n = max(world_size, 2)
    return (f"the mpicomm backend takes its ranks from MPI: launch the script with "
            f"`mpiexec -n {n} python script.py` (or mpirun / srun) instead of torchrun")


def check_agrees(rank: int, size: int, given: dict | None = None) -> None:
    """Raise if RANK / WORLD_SIZE (``given``, default: the environment) disagree with MPI's."""
    if given is None:
        given = {v: os.environ.get(v) for v in ("RANK", "WORLD_SIZE")}
    for var, mine in (("RANK", rank), ("WORLD_SIZE", size)):
        value = given.get(var)
        if value in (None, ""):
            continue
        try:
            theirs = int(value)
        except ValueError:
            raise ValueError(f"init_process_group: environment variable {var}={value!r} is not "
                             "an integer") from None
        if theirs != mine:
            extra = (" (this process runs under torchrun: " + launcher_hint(theirs) + ")"
                     if under_torchrun() else "")
            raise RuntimeError(
                f"init_process_group: {var}={theirs} (set by the launcher or passed as an argument) "
                f"disagrees with MPI "
                f"(rank {rank} of {size} in MPI.COMM_WORLD){extra}; unset {var} or launch so "
                "that they agree")


def _store_host(comm: MPI.Intracomm, from_env: bool = True) -> str:
    """The address the other ranks use to reach rank 0's store (collective; ``MASTER_ADDR``
    first when ``from_env``)."""
    if from_env and os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    nodes = comm.allgather(MPI.Get_processor_name())
    if len(set(nodes)) == 1:
        return "127.0.0.1"
    host = None
    if comm.Get_rank() == 0:
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = socket.gethostname()
    return comm.bcast(host, root=0)


def mpi_store(timeout: datetime.timedelta, comm: MPI.Intracomm = MPI.COMM_WORLD,
              from_env: bool = True):
    """A TCPStore hosted by rank 0 of ``comm`` and reachable from every rank (collective).
    ``from_env``: ``MASTER_ADDR``/``MASTER_PORT`` first (else rank 0's address, a free port)."""
    from torch.distributed import TCPStore

    rank, size = comm.Get_rank(), comm.Get_size()
    host = _store_host(comm, from_env)
    port = int((os.environ.get("MASTER_PORT") if from_env else None) or 0)
    store, error = None, ""
    if rank == 0:
        try:
            store = TCPStore(host, port, size, is_master=True, timeout=timeout,
                             wait_for_workers=False)
            port = store.port
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            error = f"rank 0 could not host a TCPStore on port {port}: {exc}"
    port, error = comm.bcast((port, error), root=0)
    if not error and rank != 0:
        try:
            store = TCPStore(host, port, size, is_master=False, timeout=timeout)
        except Exception as exc:  # noqa: BLE001
            error = f"rank {rank} could not reach rank 0's TCPStore at {host}:{port}: {exc}"
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise RuntimeError("init_process_group: " + "; ".join(dict.fromkeys(errors)))
    if rank == 0:
        logging.getLogger("mpicomm").info("init_process_group: %d ranks from MPI, TCPStore on "
                                          "rank 0 at %s:%d", size, host, port)
    return store


def _mpi_env_handler(original):
    def handler(url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30), **kwargs):
        query = dict(kv.split("=", 1) for kv in urlparse(url).query.split("&") if "=" in kv)
        given = {"RANK": query.get("rank") or os.environ.get("RANK"),
                 "WORLD_SIZE": query.get("world_size") or os.environ.get("WORLD_SIZE")}
        complete = all(given.values()) and all(os.environ.get(v) for v in ("MASTER_ADDR", "MASTER_PORT"))
        if complete or (under_torchrun() and not under_mpi_launcher()):
            yield from original(url, timeout=timeout, **kwargs)
            return
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        try:
            check_agrees(rank, size, given)
            error = ""
        except (RuntimeError, ValueError) as exc:
            error = str(exc)
        errors = [e for e in comm.allgather(error) if e]
        if errors:  # every rank raises, so none waits for the store
            raise RuntimeError(error or f"init_process_group failed on another rank: {errors[0]}")
        yield (mpi_store(timeout, comm), rank, size)
        raise RuntimeError("Unable to perform re-rendezvous using env:// with ranks from MPI")

    handler.__mpicomm__ = True  # type: ignore[attr-defined]
    return handler


def install() -> None:
    """Make ``env://`` take rank, size and the store from MPI when launcher variables are missing."""
    import torch.distributed  # noqa: F401 - loads torch.distributed.rendezvous

    rdzv = sys.modules["torch.distributed.rendezvous"]
    current = rdzv._rendezvous_handlers["env"]
    if not getattr(current, "__mpicomm__", False):
        rdzv._rendezvous_handlers["env"] = _mpi_env_handler(current)
