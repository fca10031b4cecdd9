#!/usr/bin/env bash
# Run the whole test suite: once as one process, then the multi-rank tests at 2 and 4 ranks.
# Any failing rank aborts its job (python -m mpi4py + an abort-on-failure hook); every launch
# carries a timeout. Extra arguments go to every pytest run. MPICOMM_MPI picks the MPI (and the
# venv, see bootstrap.sh); jobs start through scripts/mpirun.sh (Open MPI as root, oversubscription).
# MPICOMM_TEST_RANKS="2 4" sets the multi-rank passes; MPICOMM_TEST_SLOW=0 deselects tests marked slow,
# MPICOMM_TEST_ONCE=0 those marked once (the same on any MPI: a second MPI's run leaves them out).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export MPICOMM_DEEPSPEED="${MPICOMM_DEEPSPEED:-1}"  # the DeepSpeed interop tests run by default
started=$(date +%s)
. scripts/bootstrap.sh
times=("venv ready: $(( $(date +%s) - started ))s")
set +e  # bootstrap runs with -e; here every launch runs and reports, whatever the others did
launch_timeout="${MPICOMM_TEST_TIMEOUT:-900}"
status=0
passed=0; failed=0; skipped=0
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
count() {  # add up pytest's closing line ("3 failed, 10 passed, 2 skipped in 4.2s")
    local line n before=$failed
    # -a: the log is text whatever bytes it holds (an MPI library string may end in a NUL)
    line="$(grep -aE "^=*.* in [0-9.]+s" "$log" | grep -aE "passed|failed|skipped|error" | tail -1)"
    n=$(grep -oE "[0-9]+ passed" <<<"$line" | cut -d' ' -f1); passed=$((passed + ${n:-0}))
    n=$(grep -oE "[0-9]+ failed" <<<"$line" | cut -d' ' -f1); failed=$((failed + ${n:-0}))
    n=$(grep -oE "[0-9]+ errors?" <<<"$line" | cut -d' ' -f1); failed=$((failed + ${n:-0}))
    n=$(grep -oE "[0-9]+ skipped" <<<"$line" | cut -d' ' -f1); skipped=$((skipped + ${n:-0}))
    counted_failures=$((failed - before))
}
run() {
    echo
    echo "=== $* ==="
    local t0=$(date +%s)
    timeout -k 10 "$launch_timeout" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    times+=("$label: $(( $(date +%s) - t0 ))s")
    count
    if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then
        echo "!!! failed with exit code $rc: $*"
        status=1
        # a launch that died (abort, timeout, bad arguments) without counting a failure counts one
        [ "$counted_failures" -eq 0 ] && failed=$((failed + 1))
    fi
}
leave_out=""
[ "${MPICOMM_TEST_SLOW:-1}" = 0 ] && leave_out+=" and not slow"
[ "${MPICOMM_TEST_ONCE:-1}" = 0 ] && leave_out+=" and not once"
one_mark=(); multi_mark="mpi$leave_out"
[ -n "$leave_out" ] && one_mark=(-m "${leave_out# and }")
label="1 process"
run python -m pytest --with-mpi --durations=25 --durations-min=10 "${one_mark[@]+"${one_mark[@]}"}" "$@"   # (the slowest, for CI time)
for n in ${MPICOMM_TEST_RANKS:-2 4}; do
    label="$n ranks"
    run scripts/mpirun.sh -n "$n" python -m mpi4py scripts/mpi_pytest.py --with-mpi -m "$multi_mark" \
        -p no:cacheprovider "$@"
done
echo
times+=("total: $(( $(date +%s) - started ))s")
joined=""; for t in "${times[@]}"; do joined+="${joined:+, }$t"; done
echo "times: $joined"
if [ $status -eq 0 ]; then echo "ALL TEST RUNS PASSED"; else echo "SOME TEST RUNS FAILED"; fi
echo "tests: $passed passed, $failed failed, $skipped skipped"
exit $status
