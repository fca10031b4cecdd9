#!/usr/bin/env bash
# The main job: a short showcase on 2 local ranks with the embedded MPI (MPICOMM_MPI, see bootstrap.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
. scripts/bootstrap.sh
exec timeout -k 10 "${MPICOMM_DEMO_TIMEOUT:-600}" scripts/mpirun.sh -n "${MPICOMM_DEMO_RANKS:-2}" python -m mpi4py -m bench demo "$@"
