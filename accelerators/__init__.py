"""Device layer for mpicomm: one lazily created accelerator per process, CUDA-aware MPI detection.

Importing this package never initialises CUDA.

What lives where: ``abstract`` (the Accelerator interface), ``cpu`` and ``cuda`` (the two
accelerators), ``registry`` (``get_accelerator``/``set_accelerator``), ``local_rank`` (the
launcher-aware local rank that mpicomm uses too), ``cuda_aware`` (the CUDA-aware MPI verdict),
``mpi_lib`` (the MPI library behind mpi4py and its cleaned strings), ``flags`` (boolean env
settings), ``diagnose`` and ``__main__`` (``python -m accelerators``).
"""
from .abstract import Accelerator, LocalRankWarning
from .cpu import CpuAccelerator
from .cuda import CudaAccelerator
from .cuda_aware import CudaAwareVerdict, detect_cuda_aware
from .local_rank import LocalRank, detect_local_rank
from .registry import ACCELERATORS, get_accelerator, select_accelerator, set_accelerator

__all__ = [
    "ACCELERATORS",
    "Accelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "CudaAwareVerdict",
    "LocalRank",
    "LocalRankWarning",
    "detect_cuda_aware",
    "detect_local_rank",
    "get_accelerator",
    "select_accelerator",
    "set_accelerator",
]
