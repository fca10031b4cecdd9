"""Horovod's own PyTorch test suite on mpicomm.horovod, under mpiexec: the conformance job.

    python tests/horovod_conformance.py --ranks 2 [-k PATTERN] [--json OUT] [-v]

runs ``test/parallel/test_torch.py`` of Horovod 0.28.1 (as Horovod's CI runs it:
``mpirun -np N python -m pytest``) with ``import horovod.torch as hvd`` resolved to
``mpicomm.horovod`` by a pytest plugin (``tests/horovod_conformance_plugin.py``). Horovod's
files are never part of this repository: they are looked for in ``$MPICOMM_HOROVOD_TESTS``, then
in the cache ``<venv>/horovod-tests/`` (ignored by git), else fetched into the cache (from a local
git clone or mirror of Horovod named by ``$MPICOMM_HOROVOD_GIT``, the PyPI sdist if it carries
them, else GitHub's tagged file); when that is impossible the job says so and exits 3. Tests listed in :data:`EXCLUDED` are not run, each with its reason. A test that
hangs past ``--timeout`` or takes the job down is killed and reported by name, and the job starts
again at the next test. Exits 1 when a test that is not excluded fails (a skip is not a failure:
the suite skips GPU tests itself on a machine without one).
"""
from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VERSION = "0.28.1"
FILES = ("test/parallel/test_torch.py", "test/utils/common.py")
CACHE = os.path.join(sys.prefix, "horovod-tests", f"horovod-{VERSION}")

#: Tests not run, each with the reason (what no Horovod replacement on MPI can pass, or what
#: this torch makes impossible for any implementation).
EXCLUDED: dict[str, str] = {}


def suite_dir() -> tuple[str | None, str]:
    """(directory holding Horovod's test/ files, how it was found) or (None, why not)."""
    given = os.environ.get("MPICOMM_HOROVOD_TESTS")
    for d in ([given] if given else []) + [CACHE]:
        if all(os.path.exists(os.path.join(d, f)) for f in FILES):
            return d, f"Horovod {VERSION} tests in {d}"
    notes = []
    repo = os.environ.get("MPICOMM_HOROVOD_GIT")
    if repo:
        try:
            _from_git(repo, CACHE)
            return CACHE, f"Horovod {VERSION} tests from the git repository {repo} (tag v{VERSION}), cached in {CACHE}"
        except Exception as exc:  # noqa: BLE001 - reported
            notes.append(f"MPICOMM_HOROVOD_GIT={repo}: {exc}")
    try:
        if _from_sdist(CACHE):
            return CACHE, f"Horovod {VERSION} tests from the PyPI sdist, cached in {CACHE}"
        notes.append(f"the PyPI sdist horovod=={VERSION} does not carry {FILES[0]}")
    except Exception as exc:  # noqa: BLE001 - reported
        notes.append(f"pip download of the sdist failed: {exc}")
    try:
        _from_github(CACHE)
        return CACHE, f"Horovod {VERSION} tests from github.com/horovod/horovod (tag v{VERSION}), cached in {CACHE}"
    except Exception as exc:  # noqa: BLE001 - reported
        notes.append(f"raw.githubusercontent.com unreachable ({exc})")
    return None, ("Horovod's test suite is not available: " + "; ".join(notes) +
                  f". Put {', '.join(FILES)} of Horovod v{VERSION} under a directory and set "
                  f"MPICOMM_HOROVOD_TESTS to it (or into {CACHE}), or name a git clone of Horovod "
                  f"in MPICOMM_HOROVOD_GIT.")


def _from_sdist(dest: str) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", f"horovod=={VERSION}", "-d", tmp],
                       check=True, capture_output=True, timeout=300)
        tars = [f for f in os.listdir(tmp) if f.endswith(".tar.gz")]
        with tarfile.open(os.path.join(tmp, tars[0])) as tar:
            members = {m.name.split("/", 1)[-1]: m for m in tar.getmembers()}
            if not all(f in members for f in FILES):
                return False
            for f in FILES:
                _save(dest, f, tar.extractfile(members[f]).read())
    return True


def _from_git(repo: str, dest: str) -> None:
    """The files at tag v{VERSION} of a local git clone or mirror (``git show``, nothing checked out)."""
    for f in FILES:
        proc = subprocess.run(["git", "--git-dir", _git_dir(repo), "show", f"v{VERSION}:{f}"],
                              capture_output=True, timeout=60)
        if proc.returncode:
            raise RuntimeError(f"git show v{VERSION}:{f} failed: {proc.stderr.decode(errors='replace').strip()}")
        _save(dest, f, proc.stdout)


def _git_dir(repo: str) -> str:
    """A clone's .git, or the repository itself when it is bare (a mirror)."""
    dot = os.path.join(repo, ".git")
    return dot if os.path.isdir(dot) else repo


def _from_github(dest: str) -> None:
    for f in FILES:
        url = f"https://raw.githubusercontent.com/horovod/horovod/v{VERSION}/{f}"
        with urllib.request.urlopen(url, timeout=20) as r:
            _save(dest, f, r.read())


def _save(dest: str, rel: str, data: bytes) -> None:
    path = os.path.join(dest, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as out:
        out.write(data)


def test_names(path: str, patterns: list[str] | None = None) -> list[str]:
    """TorchTests' test methods in definition order (read, not imported)."""
    tree = ast.parse(open(path).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TorchTests")
    names = [f.name for f in cls.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")]
    if patterns:
        names = [n for n in names if any(fnmatch.fnmatch(n, p) or p in n for p in patterns)]
    return names


def _read(results: str, ranks: int) -> tuple[dict, dict]:
    """({test: {rank: end record}}, {rank: last started test}) from the ranks' files."""
    ends: dict[str, dict[int, dict]] = {}
    started: dict[int, str] = {}
    for r in range(ranks):
        try:
            with open(os.path.join(results, f"rank{r}.jsonl")) as f:
                for line in f:
                    if not line.endswith("\n"):
                        continue
                    rec = json.loads(line)
                    if rec["event"] == "start":
                        started[r] = rec["test"]
                        continue
                    prev = ends.setdefault(rec["test"], {}).get(r)
                    if prev is None or prev["outcome"] != "failed":
                        ends[rec["test"]][r] = rec
        except FileNotFoundError:
            pass
    return ends, started


def _verdict(records: dict[int, dict], ranks: int) -> dict:
    outs = [records[r]["outcome"] for r in range(ranks)]
    seconds = max(records[r].get("seconds", 0) for r in range(ranks))
    if "failed" in outs:
        detail = "\n".join(f"rank {r}: {records[r]['detail']}" for r in range(ranks)
                           if records[r]["outcome"] == "failed")
        return {"status": "failed", "seconds": seconds, "detail": detail}
    if all(o == "skipped" for o in outs):
        return {"status": "skipped", "seconds": seconds, "detail": records[0]["detail"]}
    if all(o == "passed" for o in outs):
        return {"status": "passed", "seconds": seconds, "detail": ""}
    return {"status": "failed", "seconds": seconds, "detail": f"outcomes differ by rank: {outs}"}


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_suite(directory: str, names: list[str], ranks: int, timeout: float = 120.0,
              progress=None) -> dict[str, dict]:
    """Every test of ``names`` at ``ranks`` ranks: {name: {status, seconds, detail}}."""
    sys.path.insert(0, HERE)
    from mpitest import mpiexec_cmd

    from mpicomm import clean_env

    path = os.path.join(directory, FILES[0])
    outcomes: dict[str, dict] = {}
    remaining = list(names)
    while remaining:
        results = tempfile.mkdtemp(prefix="hvd-conformance-")
        env = clean_env()
        env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, env.get("PYTHONPATH", "")])
        env["HVD_CONFORMANCE_RESULTS"] = results
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = mpiexec_cmd(ranks) + [sys.executable, "-m", "mpi4py", "-m", "pytest", "-q", "-p", "horovod_conformance_plugin", "-p",
                                    "no:cacheprovider", "--rootdir", results,
                                    "-W", "ignore::DeprecationWarning"]
        cmd += [f"{path}::TorchTests::{n}" for n in remaining]
        log_path = os.path.join(results, "job.log")
        stuck = None
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=results, start_new_session=True)
            last = time.monotonic()
            while True:
                exited = proc.poll() is not None
                ends, started = _read(results, ranks)
                for name in remaining:
                    if name not in outcomes and len(ends.get(name, {})) == ranks:
                        outcomes[name] = _verdict(ends[name], ranks)
                        last = time.monotonic()
                        if progress:
                            progress(name, outcomes[name])
                pending = [n for n in remaining if n not in outcomes]
                if not pending or exited:
                    break
                if time.monotonic() - last > timeout + (180 if not outcomes else 0):
                    stuck = "hung"
                    _kill(proc)
                    break
                time.sleep(0.2)
        pending = [n for n in remaining if n not in outcomes]
        if not pending:
            shutil.rmtree(results, ignore_errors=True)
            break
        name = pending[0]
        with open(log_path, errors="replace") as f:
            tail = f.read()[-3000:]
        if stuck is None:
            proc.wait()
            stuck = "crashed"
            if not outcomes and "ERROR collecting" in tail:
                raise RuntimeError(f"the suite did not load under pytest:\n{tail}")
        outcomes[name] = {"status": stuck, "seconds": 0.0,
                          "detail": f"{stuck} (exit code {proc.returncode}); job output:\n{tail}"}
        if progress:
            progress(name, outcomes[name])
        remaining = pending[1:]
    return outcomes


def counts(outcomes: dict[str, dict]) -> dict[str, int]:
    out = {s: 0 for s in ("passed", "failed", "skipped", "hung", "crashed")}
    for o in outcomes.values():
        out[o["status"]] += 1
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("-k", dest="patterns", action="append", help="only tests matching (glob/substr)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per test")
    p.add_argument("--json", help="write every outcome here")
    p.add_argument("-v", "--verbose", action="store_true", help="a line per test")
    args = p.parse_args(argv)
    directory, how = suite_dir()
    if directory is None:
        print(how)
        return 3
    print(how, flush=True)
    every = test_names(os.path.join(directory, FILES[0]))
    names = [n for n in test_names(os.path.join(directory, FILES[0]), args.patterns)
             if n not in EXCLUDED]
    t0 = time.monotonic()

    def show(name, o):
        if args.verbose or o["status"] not in ("passed", "skipped"):
            print(f"  [x{args.ranks}] {name}: {o['status']} ({o['seconds']:.1f} s)", flush=True)
            if o["status"] not in ("passed", "skipped"):
                print(o["detail"][-4000:], flush=True)

    outcomes = run_suite(directory, names, args.ranks, args.timeout, progress=show)
    c = counts(outcomes)
    skipped = {}
    for n, o in outcomes.items():
        if o["status"] == "skipped":
            skipped.setdefault(o["detail"].strip() or "(no reason given)", []).append(n)
    for reason, tests in skipped.items():
        print(f"skipped by the suite itself ({reason}): {', '.join(tests)}")
    for n in every:
        if n in EXCLUDED and (not args.patterns or n in test_names(
                os.path.join(directory, FILES[0]), args.patterns)):
            print(f"excluded: {n}: {EXCLUDED[n]}")
    print(f"horovod test_torch.py at {args.ranks} ranks: " +
          ", ".join(f"{v} {k}" for k, v in c.items()) +
          f", {sum(1 for n in every if n in EXCLUDED)} excluded ({len(every)} tests, "
          f"{time.monotonic() - t0:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "outcomes": outcomes, "excluded": EXCLUDED}, f, indent=1)
    return 1 if any(o["status"] not in ("passed", "skipped") for o in outcomes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
