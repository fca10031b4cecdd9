"""torch's own distributed test suite on mpicomm beside gloo, under mpiexec: the conformance job.

    python tests/conformance.py --ranks 2 [--backends gloo,mpicomm] [-k PATTERN] [--json OUT]

runs every test method of ``torch.testing._internal.distributed.distributed_test._DistTestBase``
(torch's backend suite, shipped in the wheel) once per backend, each rank doing what a child of
upstream's ``test_distributed_spawn.py`` does (``tests/conformance_job.py``). The suite runs as it
runs for gloo (its skips, the paths its tests take by backend name), and on the mpicomm run every
group it creates is an mpicomm group: mpicomm stands in for gloo, so both face the same tests. A test that hangs past
``--timeout`` or takes the job down is killed and reported by name, and the job starts again at
the next test. Prints the counts per backend and every test that passed on gloo but not on
mpicomm; exits 1 when there is one that :data:`EXEMPT` does not name. ``--beyond`` then runs on
mpicomm the tests gloo skips only for its own limits (:data:`GLOO_LIMITS`), as torch runs them for
its MPI backend, and exits 1 if one fails.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
JOB = os.path.join(HERE, "conformance_job.py")

#: Tests no backend but gloo can pass through torch's own API, each with the reason.
EXEMPT = {
    **{name: "calls dist.monitored_barrier(), which raises 'monitored_barrier is only "
             "implemented for GLOO backend' for any other backend (mpicomm serves the same call "
             "as mpicomm.distributed.monitored_barrier and the process group's monitored_barrier)"
       for name in ("test_monitored_barrier_gloo", "test_monitored_barrier_gloo_subgroup",
                    "test_monitored_barrier_failure_order",
                    "test_monitored_barrier_wait_all_ranks")},
    "test_get_backend": "asserts dist.get_backend() == the suite's BACKEND name ('gloo', the "
                        "backend mpicomm stands in for); an mpicomm group answers 'mpicomm'",
}

ERROR_CODE = 10  # MultiProcessTestCase.TEST_ERROR_EXIT_CODE
#: Tests whose exit codes upstream does not check (TestDistBackend.skip_return_code_checks).
UNCHECKED = {"test_ddp_has_finalized"}


@dataclass
class Outcome:
    """One test on one backend: passed, skipped, failed, hung or crashed, with what was seen."""

    status: str
    seconds: float = 0.0
    detail: str = ""
    codes: list = field(default_factory=list)


def _skip_codes() -> dict[int, str]:
    from torch.testing._internal.common_distributed import TEST_SKIPS

    return {s.exit_code: s.message for s in TEST_SKIPS.values()}


def test_names(patterns: list[str] | None = None) -> list[str]:
    """The suite's test methods (in definition order), those matching ``patterns`` if given."""
    os.environ.setdefault("BACKEND", "gloo")
    os.environ.setdefault("WORLD_SIZE", "2")
    from torch.testing._internal.distributed import distributed_test as dt

    base = dt.DistributedTest._DistTestBase
    names = [n for n in base.__dict__ if n.startswith("test_") and callable(base.__dict__[n])]
    if patterns:
        names = [n for n in names if any(fnmatch.fnmatch(n, p) or p in n for p in patterns)]
    return names


def judge(name: str, records: dict[int, dict], ranks: int, skips: dict[int, str]) -> Outcome:
    """Upstream's verdict (``_check_return_codes``) from every rank's exit code."""
    seconds = max(r["seconds"] for r in records.values())
    codes = [records[r]["code"] for r in range(ranks)]
    errors = [f"rank {r}:\n{records[r]['error']}" for r in range(ranks)
              if records[r]["code"] == ERROR_CODE]
    if errors:
        return Outcome("failed", seconds, "\n".join(errors), codes)
    if codes[0] == "skip":  # unittest's own skip, decided before the test starts
        return Outcome("skipped", seconds, records[0]["error"], codes)
    if name in UNCHECKED:
        return Outcome("passed", seconds, "", codes)
    if codes[0] in skips:
        return Outcome("skipped", seconds, skips[codes[0]], codes)
    if codes[0] != 0:
        return Outcome("failed", seconds, f"rank 0 exited with code {codes[0]}", codes)
    return Outcome("passed", seconds, "", codes)


def _read(results: str, ranks: int) -> dict[str, dict[int, dict]]:
    """{test: {rank: record}} from the ranks' result files, whole lines only."""
    done: dict[str, dict[int, dict]] = {}
    for rank in range(ranks):
        try:
            with open(os.path.join(results, f"rank{rank}.jsonl")) as f:
                for line in f:
                    if line.endswith("\n"):
                        rec = json.loads(line)
                        done.setdefault(rec["test"], {})[rank] = rec
        except FileNotFoundError:
            pass
    return done


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _launch(backend: str, skips_of: str, names: list[str], ranks: int, results: str,
            log) -> subprocess.Popen:
    sys.path.insert(0, HERE)
    from mpitest import mpiexec_cmd

    from mpicomm import clean_env

    tests_file = os.path.join(results, "tests.txt")
    with open(tests_file, "w") as f:
        f.write("\n".join(names) + "\n")
    env = clean_env()
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "BACKEND",
              "INIT_METHOD", "TEMP_DIR"):
        env.pop(k, None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = mpiexec_cmd(ranks) + [sys.executable, "-m", "mpi4py", JOB, "--backend", backend,
                                "--skips-of", skips_of, "--tests", tests_file,
                                "--results", results]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)


def run_suite(backend: str, names: list[str], ranks: int, *, skips_of: str = "gloo",
              timeout: float = 120.0, grace: float = 10.0, startup: float = 120.0,
              progress=None) -> dict[str, Outcome]:
    """Every test of ``names`` on ``backend`` at ``ranks`` ranks: {name: Outcome}."""
    skips = _skip_codes()
    outcomes: dict[str, Outcome] = {}
    remaining = list(names)
    while remaining:
        results = tempfile.mkdtemp(prefix=f"conformance-{backend}-")
        log_path = os.path.join(results, "job.log")
        with open(log_path, "w") as log:
            proc = _launch(backend, skips_of, remaining, ranks, results, log)
            last = time.monotonic()  # launch, or the last test every rank finished
            allowance = startup + timeout  # the first test also waits for the job to start
            error_seen: float | None = None
            stuck: tuple[str, str, str] | None = None  # (test, status, detail)
            while True:
                exited = proc.poll() is not None
                done = _read(results, ranks)
                for name in remaining:
                    if name in outcomes or len(done.get(name, {})) < ranks:
                        continue
                    outcomes[name] = judge(name, done[name], ranks, skips)
                    last, allowance, error_seen = time.monotonic(), timeout, None
                    if progress:
                        progress(name, outcomes[name])
                pending = [n for n in remaining if n not in outcomes]
                if not pending or exited:
                    break
                name = pending[0]
                finished = done.get(name, {})
                failed_on = sorted(r for r, rec in finished.items() if rec["code"] == ERROR_CODE)
                now = time.monotonic()
                if failed_on and error_seen is None:
                    error_seen = now
                if now - last > allowance:
                    stuck = (name, "hung", f"killed after {now - last:.0f} s; ranks that "
                             f"finished it: {sorted(finished)}")
                elif error_seen is not None and now - error_seen > grace:
                    stuck = (name, "failed", f"ranks {sorted(set(range(ranks)) - set(finished))}"
                             f" did not finish it {grace:g} s after rank(s) {failed_on} failed")
                if stuck:
                    _kill(proc)
                    break
                time.sleep(0.2)
        pending = [n for n in remaining if n not in outcomes]
        if not pending:
            break
        name = pending[0]
        done = _read(results, ranks)
        errors = "\n".join(f"rank {r}:\n{rec['error']}" for r, rec in
                           sorted(done.get(name, {}).items()) if rec["error"])
        with open(log_path, errors="replace") as f:
            tail = f.read()[-3000:]
        if stuck is None:
            proc.wait()
            stuck = (name, "crashed", f"the job ended (exit code {proc.returncode}) inside it")
        outcomes[name] = Outcome(stuck[1], 0.0, f"{stuck[2]}\n{errors}\njob output:\n{tail}")
        if progress:
            progress(name, outcomes[name])
        remaining = pending[1:]
    return outcomes


def compare(results: dict[str, dict[str, Outcome]], reference: str = "gloo",
            subject: str = "mpicomm") -> tuple[list[str], list[str]]:
    """(tests passing on ``reference`` but not on ``subject``, of those the exempt ones)."""
    ref, sub = results[reference], results[subject]
    missing = [n for n, o in ref.items() if o.status == "passed" and sub[n].status != "passed"]
    return [n for n in missing if n not in EXEMPT], [n for n in missing if n in EXEMPT]


def counts(outcomes: dict[str, Outcome]) -> dict[str, int]:
    out = {s: 0 for s in ("passed", "failed", "skipped", "hung", "crashed")}
    for o in outcomes.values():
        out[o.status] += 1
    return out


#: gloo's skip reasons for what only its own limits keep it from (torch runs these tests for MPI).
GLOO_LIMITS = ("Only MPI supports",)


def _beyond_gloo(results: dict[str, dict[str, Outcome]], args) -> int:
    """Run on mpicomm, standing in for torch's MPI backend, the tests gloo skips for its own
    limits (upstream runs them for MPI, at 3 ranks); 1 if one does not pass."""
    names = [n for n, o in results["gloo"].items()
             if o.status == "skipped" and any(r in o.detail for r in GLOO_LIMITS)]
    outcomes = run_suite("mpicomm", names, args.ranks, skips_of="mpi", timeout=args.timeout)
    results["mpicomm-beyond-gloo"] = outcomes
    passed = [n for n, o in outcomes.items() if o.status == "passed"]
    bad = [n for n, o in outcomes.items() if o.status not in ("passed", "skipped")]
    print(f"beyond gloo (skipped there for its own limits, run as for MPI): {len(passed)} of "
          f"{len(names)} pass on mpicomm: {', '.join(passed)}")
    for name in bad:
        print(f"BEYOND GLOO, FAILED: {name}: {outcomes[name].status}\n{outcomes[name].detail}\n")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--backends", default="gloo,mpicomm")
    p.add_argument("--skips-of", default="gloo", help="decide skips as upstream does for this")
    p.add_argument("-k", dest="patterns", action="append", help="only tests matching (glob/substr)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per test")
    p.add_argument("--json", help="write every outcome here")
    p.add_argument("-v", "--verbose", action="store_true", help="a line per test")
    p.add_argument("--beyond", action="store_true",
                   help="also run, on mpicomm as for MPI, the tests gloo skips for its own limits "
                        "(at 3 ranks or more, as upstream runs MPI's)")
    args = p.parse_args(argv)
    names = test_names(args.patterns)
    backends = args.backends.split(",")
    results: dict[str, dict[str, Outcome]] = {}
    for backend in backends:
        t0 = time.monotonic()

        def show(name, o, backend=backend):
            if args.verbose or o.status not in ("passed", "skipped"):
                print(f"  [{backend} x{args.ranks}] {name}: {o.status} ({o.seconds:.1f} s)",
                      flush=True)

        results[backend] = run_suite(backend, names, args.ranks, skips_of=args.skips_of,
                                     timeout=args.timeout, progress=show)
        c = counts(results[backend])
        print(f"{backend} at {args.ranks} ranks: " + ", ".join(f"{v} {k}" for k, v in c.items())
              + f" ({len(names)} tests, {time.monotonic() - t0:.0f} s)", flush=True)
    status = 0
    if "gloo" in results and "mpicomm" in results:
        missing, exempt = compare(results)
        for name in exempt:
            print(f"exempt: {name}: {EXEMPT[name]}")
        for name in missing:
            o = results["mpicomm"][name]
            print(f"DIFFERENCE: {name} passed on gloo, {o.status} on mpicomm:\n{o.detail}\n")
        beyond = [n for n, o in results["mpicomm"].items()
                  if o.status == "passed" and results["gloo"][n].status != "passed"]
        print(f"passed on gloo, not on mpicomm: {len(missing)} (+{len(exempt)} exempt); "
              f"passed on mpicomm, not on gloo: {len(beyond)}")
        status = 1 if missing else 0
        if args.beyond and args.ranks >= 3:
            status |= _beyond_gloo(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({b: {n: o.__dict__ for n, o in r.items()} for b, r in results.items()}, f,
                      indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
