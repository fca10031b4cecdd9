"""Small helpers shared across the project: boolean env flags, byte sizes, a launch environment."""
from __future__ import annotations

import os
from typing import Mapping, Sequence

from accelerators.flags import env_flag, parse_flag

__all__ = ["env_flag", "parse_flag", "format_bytes", "clean_env", "LAUNCHER_PREFIXES"]

#: Per-job variables MPI launchers set (MPICH/Hydra, Open MPI/PRRTE, PMIx, Intel MPI, MVAPICH, Cray).
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "MPI_", "MPIR_", "HYDRA_", "HYDI_", "OMPI_", "PRTE_",
                     "I_MPI_", "MV2_", "PALS_")
#: User settings under those prefixes that a fresh launch still needs (Open MPI as root, MCA).
_KEEP = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_MCA_", "PRTE_MCA_")


def clean_env(drop: Sequence[str] = (), env: Mapping[str, str] | None = None) -> dict:
    """This environment without the MPI launcher's per-job variables, for launching a fresh job.

    User settings (``OMPI_ALLOW_RUN_AS_ROOT*``, ``OMPI_MCA_*``, ``PRTE_MCA_*``) pass through;
    ``drop`` names more prefixes to remove.
    """
    prefixes = LAUNCHER_PREFIXES + tuple(drop)
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if not k.startswith(prefixes) or k.startswith(_KEEP)}


def format_bytes(n: float, compact: bool = False) -> str:
    """A byte count for people: "512 B", "1.5 MiB".

    ``compact``: exact binary multiples as size arguments take them ("8", "4K", "64M"), else the
    plain number.
    """
    units = (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10))
    if compact:
        for unit, scale in units:
            if n >= scale and n % scale == 0:
                return f"{int(n) // scale}{unit}"
        return str(int(n))
    for unit, scale in units:
        if n >= scale:
            return f"{n / scale:.1f} {unit}iB"
    return f"{int(n)} B"
