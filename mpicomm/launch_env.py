"""The environment for launching a fresh MPI job from inside one: the launcher's variables removed."""
from __future__ import annotations

import os
from typing import Mapping, Sequence

__all__ = ["clean_env", "LAUNCHER_PREFIXES"]

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
