"""MPI benchmark programs for mpicomm."""
