#!/usr/bin/env bash
# Launch an MPI job the same way everywhere (test.sh, demo.sh, gpu_check.sh, the tests' own jobs):
#   scripts/mpirun.sh [--mpiexec PATH] -n N [more mpiexec options] PROGRAM [ARGS...]
# The mpiexec is PATH, else $MPICOMM_MPIEXEC, else the first on PATH. Its flavour comes from
# `mpiexec --version`. Open MPI: as root, OMPI_ALLOW_RUN_AS_ROOT=1 and
# OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set (prterun refuses root without them); with more ranks
# than cores, --oversubscribe is added (Open MPI gives each rank a core by default). MPICH's Hydra
# needs neither. `scripts/mpirun.sh --explain -n N` prints what would be done, runs nothing.
set -euo pipefail
mpiexec="${MPICOMM_MPIEXEC:-}"
explain=0
while [ $# -gt 0 ]; do
    case "$1" in
        --mpiexec) mpiexec="$2"; shift 2 ;;
        --mpiexec=*) mpiexec="${1#*=}"; shift ;;
        --explain) explain=1; shift ;;
        *) break ;;
    esac
done
if [ -z "$mpiexec" ]; then
    mpiexec="$(command -v mpiexec || true)"
fi
if [ -z "$mpiexec" ] || [ ! -x "$mpiexec" ]; then
    echo "mpirun.sh: no mpiexec found (expected one on PATH, in \$MPICOMM_MPIEXEC or --mpiexec)" >&2
    exit 127
fi

# ranks requested: the first -n/-np N (put it first: later words may belong to the program)
ranks=1
prev=""
for arg in "$@"; do
    case "$prev" in -n|-np|--n|--np) ranks="$arg"; break ;; esac
    case "$arg" in -n=*|-np=*|--n=*|--np=*) ranks="${arg#*=}"; break ;; esac
    prev="$arg"
done
case "$ranks" in ''|*[!0-9]*) echo "mpirun.sh: expected -n N with a number, got '$ranks'" >&2; exit 2 ;; esac

cores() {  # physical cores this process may use (what Open MPI counts as slots)
    local online physical=""
    online="$(nproc 2>/dev/null || echo 1)"
    if command -v lscpu >/dev/null 2>&1; then
        physical="$(lscpu -p=core,socket 2>/dev/null | grep -v '^#' | sort -u | wc -l)"
    fi
    if [ -n "$physical" ] && [ "$physical" -gt 0 ] && [ "$physical" -lt "$online" ]; then
        echo "$physical"
    else
        echo "$online"
    fi
}

version="$("$mpiexec" --version 2>&1 || true)"
flavour=other
case "$version" in
    *"Open MPI"*|*"OpenRTE"*|*"PRRTE"*|*"prterun"*) flavour=openmpi ;;
    *HYDRA*|*Hydra*) flavour=mpich ;;
esac

extra=()
notes=()
if [ "$flavour" = openmpi ]; then
    if [ "$(id -u)" = 0 ]; then
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
        notes+=("root: OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
    fi
    # on one host the libfabric transport (btl ofi) adds 1.0 s to every MPI_Init here and carries
    # nothing (sm and tcp do); left out unless the user chose transports, named hosts or runs under
    # a batch allocation. Not with fault tolerance (--with-ft, mpi_ft_enable): mpicomm then sets
    # btl tcp,self where the variable is unset (mpicomm.ft_env)
    local_only=1
    for arg in "$@"; do
        case "$arg" in
            -H|-H=*|--host|--host=*|-host|--hostfile|--hostfile=*|-hostfile|--machinefile|--machinefile=*|-machinefile|--default-hostfile|--default-hostfile=*|--with-ft|--with-ft=*|btl|mpi_ft_enable) local_only=0 ;;
        esac
    done
    if [ "$local_only" = 1 ] && [ -z "${OMPI_MCA_btl:-}${OMPI_MCA_mpi_ft_enable:-}" ] && [ -z "${SLURM_JOB_ID:-}${PBS_JOBID:-}${LSB_JOBID:-}${FLUX_JOB_ID:-}" ]; then
        export OMPI_MCA_btl="^ofi"
        notes+=("one host: OMPI_MCA_btl=^ofi (libfabric's transport added 1 s to each MPI_Init)")
    fi
    ncores="$(cores)"
    if [ "$ranks" -gt "$ncores" ]; then
        extra+=(--oversubscribe)
        notes+=("$ranks ranks > $ncores cores: --oversubscribe")
    fi
fi

if [ "$explain" = 1 ]; then
    echo "mpiexec: $mpiexec ($flavour)"
    for note in "${notes[@]+"${notes[@]}"}"; do echo "$note"; done
    echo "command: $mpiexec ${extra[*]+"${extra[*]}"} $*"
    exit 0
fi
exec "$mpiexec" "${extra[@]+"${extra[@]}"}" "$@"
