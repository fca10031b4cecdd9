"""Whether the launcher enabled fault tolerance (ULFM), and the MCA defaults that needs.

No MPI here: :func:`set_launch_defaults` runs when mpicomm is imported, before MPI starts.
"""
from __future__ import annotations

import os
import sys

#: The variable ``mpirun --with-ft ulfm`` (Open MPI's prterun) sets in every process it starts.
FT_VAR = "OMPI_MCA_mpi_ft_enable"
_TRUE = ("1", "true", "t", "yes", "y", "on", "enabled")


def launched_with_ft(environ=os.environ) -> bool:
    """Whether the launcher enabled fault tolerance (``mpirun --with-ft ulfm`` sets
    ``OMPI_MCA_mpi_ft_enable=1``)."""
    return environ.get(FT_VAR, "").strip().lower() in _TRUE


#: What fault tolerance needs, unless the user chose otherwise (measured: ``mpicomm.faults``).
FT_DEFAULTS = {
    # over shared memory a rank that exits with a non-zero status is never reported failed,
    # and its survivors hang; TCP notices the broken connection
    "OMPI_MCA_btl": "tcp,self",
    # collective MPI-IO (fcoll vulcan) crashed (SIGSEGV) the survivors of a rank that died in
    # MPI_File_write_at_all; each rank's own writes raise the failure instead
    "OMPI_MCA_fcoll": "individual",
}


#: Set by :func:`set_launch_defaults` when MPI had started before it ran, under fault tolerance,
#: with no transport chosen: then ranks on one host share memory and a death can hang them.
too_late: str | None = None


def mpi_started(modules=sys.modules) -> bool:
    """Whether this process has started MPI already (through mpi4py)."""
    mpi = modules.get("mpi4py.MPI")
    return bool(mpi is not None and mpi.Is_initialized())


def set_launch_defaults(environ=os.environ, started: bool | None = None) -> None:
    """Under ``mpirun --with-ft ulfm``, :data:`FT_DEFAULTS` for what the user did not set (e.g.
    with ``--mca btl ...``). Call before MPI starts; nothing happens otherwise. Where MPI has
    started already and the user chose no transport, :data:`too_late` says so
    (``mpicomm.faults.fault_tolerant`` then raises)."""
    global too_late
    too_late = None
    if not launched_with_ft(environ):
        return
    if (mpi_started() if started is None else started) and "OMPI_MCA_btl" not in environ:
        too_late = ("MPI started before mpicomm was imported, so its defaults for `mpirun --with-ft "
                    "ulfm` came too late: ranks on one host talk over shared memory, where a rank that "
                    "exits with a non-zero status is never reported failed and its survivors hang. "
                    "Import mpicomm (or elastic) before `from mpi4py import MPI`, or launch with "
                    "`--mca btl tcp,self`")
    for name, value in FT_DEFAULTS.items():
        environ.setdefault(name, value)
