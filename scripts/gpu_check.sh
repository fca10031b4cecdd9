#!/usr/bin/env bash
# The GPU test set, for a machine with an NVIDIA GPU: accelerator, CUDA tensors and cupy arrays
# through the staged and (if MPI is CUDA-aware) direct paths, at 1 and 2 ranks.
# Uses the current python if it already has torch with CUDA and mpi4py; otherwise bootstraps.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if ! python3 -c "import torch, mpi4py, pytest_mpi; assert torch.cuda.is_available()" 2>/dev/null; then
    . scripts/bootstrap.sh
fi
py="$(command -v python3)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
"$py" -m accelerators || true
status=0
tests="tests/test_acc_gpu.py tests/test_cco_gpu.py $(ls tests/test_*gpu*.py 2>/dev/null | grep -v -e test_acc_gpu -e test_cco_gpu | tr '\n' ' ')"
timeout 600 "$py" -m pytest --with-mpi -m gpu -p no:cacheprovider $tests "$@" || status=1
for n in 2; do
    timeout 600 scripts/mpirun.sh -n $n "$py" -m mpi4py scripts/mpi_pytest.py --with-mpi -m "gpu and mpi" \
        -p no:cacheprovider $tests "$@" || status=1
done
MPICOMM_CUDA_AWARE=0 timeout 600 scripts/mpirun.sh -n 2 "$py" -m mpi4py scripts/mpi_pytest.py --with-mpi \
    -m "gpu and mpi" -p no:cacheprovider tests/test_cco_gpu.py "$@" || status=1
exit $status
