"""A per-rank diagnosis: accelerator, devices, local rank, MPI library, CUDA-aware verdict."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .abstract import Accelerator
from .cuda_aware import CudaAwareVerdict, detect_cuda_aware
from .local_rank import detect_local_rank
from .registry import get_accelerator


def collect(acc: Optional[Accelerator] = None) -> Dict[str, Any]:
    """This rank's diagnosis as a JSON-ready dict (collective: checks the local rank with MPI)."""
    from mpi4py import MPI

    from . import mpi_lib

    acc = get_accelerator() if acc is None else acc
    local = detect_local_rank(explicit=acc._explicit_local_rank, cross_check=True)
    count = acc.device_count()
    verdict = acc.cuda_aware_verdict()
    lib = None
    try:
        lib = mpi_lib.mpi_library()
    except Exception:  # noqa: BLE001 - the diagnosis reports what it can
        pass
    # What the MPI library itself says, whatever the accelerator (e.g. a GPU torch cannot see).
    try:
        mpi_says = detect_cuda_aware(info=mpi_lib.world_info(), lib=lib)
    except ValueError as exc:  # bad MPICOMM_CUDA_AWARE
        mpi_says = CudaAwareVerdict(None, "error", str(exc))
    return {
        "rank": MPI.COMM_WORLD.Get_rank(),
        "size": MPI.COMM_WORLD.Get_size(),
        "host": MPI.Get_processor_name(),
        "accelerator": acc.name,
        "selected_by": acc.selected_by,
        "device_count": count,
        "device": acc.device_name(local.device_index(max(1, count))),
        "details": [list(line) for line in acc.describe()],
        "local_rank": local.rank,
        "local_size": local.size,
        "local_rank_source": local.source,
        "local_rank_warnings": list(local.warnings),
        "mpi": mpi_lib.library_summary(),
        "mpi_library_path": mpi_lib.library_path(lib) if lib is not None else "(not found)",
        "cuda_aware": verdict.label,
        "cuda_aware_source": verdict.source,
        "cuda_aware_reason": verdict.reason,
        "mpi_cuda_support": mpi_says.label,
        "mpi_cuda_support_reason": f"{mpi_says.reason} (source: {mpi_says.source})",
    }


def format_report(d: Dict[str, Any]) -> str:
    """Human-readable lines for one rank's diagnosis."""
    lines: List[str] = [
        f"rank {d['rank']} of {d['size']} on {d['host']}",
        f"  accelerator:      {d['accelerator']} ({d['selected_by']})",
        f"  devices:          {d['device_count']} visible; this rank uses {d['device']}",
    ]
    lines += [f"  {label + ':':<18}{value}" for label, value in d["details"]]
    size = "?" if d["local_size"] is None else d["local_size"]
    lines.append(f"  local rank:       {d['local_rank']} of {size} (from {d['local_rank_source']})")
    lines += [f"  WARNING:          {w}" for w in d["local_rank_warnings"]]
    mpi = d["mpi"]
    lines += [
        f"  MPI:              {mpi['vendor']}, MPI standard {mpi['standard']} ({mpi['library']})",
        f"  MPI library:      {d['mpi_library_path']}",
        f"  CUDA-aware MPI:   {d['cuda_aware']} (source: {d['cuda_aware_source']})",
        f"  why:              {d['cuda_aware_reason']}",
        f"  MPI CUDA support: {d['mpi_cuda_support']}: {d['mpi_cuda_support_reason']}",
    ]
    return "\n".join(lines)
