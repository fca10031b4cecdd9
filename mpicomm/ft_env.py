"""Whether the launcher enabled fault tolerance (ULFM), and the transport default that needs.

No MPI here: :func:`set_launch_defaults` runs when mpicomm is imported, before MPI starts.
"""
from __future__ import annotations

import os

#: The variable ``mpirun --with-ft ulfm`` (Open MPI's prterun) sets in every process it starts.
FT_VAR = "OMPI_MCA_mpi_ft_enable"
_TRUE = ("1", "true", "t", "yes", "y", "on", "enabled")


def launched_with_ft(environ=os.environ) -> bool:
    """Whether the launcher enabled fault tolerance (``mpirun --with-ft ulfm`` sets
    ``OMPI_MCA_mpi_ft_enable=1``)."""
    return environ.get(FT_VAR, "").strip().lower() in _TRUE


def set_launch_defaults(environ=os.environ) -> None:
    """Under ``mpirun --with-ft ulfm``, TCP between ranks on one node unless the user chose the
    transports (``OMPI_MCA_btl``, e.g. ``--mca btl ...``): over shared memory a rank that exits
    with a non-zero status is never reported failed and its survivors hang (see
    ``mpicomm.faults``). Call before MPI starts; nothing happens otherwise."""
    if launched_with_ft(environ) and "OMPI_MCA_btl" not in environ:
        environ["OMPI_MCA_btl"] = "tcp,self"
