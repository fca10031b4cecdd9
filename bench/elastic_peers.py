"""Peers beside elastic, one run: the same MLP, Adam, 4 workers, worker 1 killed at step
``--kill-step``, in torchft 0.2 (optional: skipped with a note where it is not installed),
torchrun ``--max-restarts 1`` with a DCP checkpoint after every step, and elastic under ULFM,
once as it only shrinks, once growing back (``max_world_size=4``: a replacement spawned after the
loss) and once with a spare (``spare=True``: spawned at the first commit, ready before the loss).

    python -m bench elastic --peers --params 20M --kill-step 3 [--peers-kill-at backward]

``--peers-kill-at``: worker 1 dies at the start of its step (torchft: before it joins the step's
quorum) or in its backward (the other workers' gradient reductions under way).

Run as one process; everything on loopback. Per system: detection (the death to the survivors
seeing the failure: elastic's recovery starting; torchft's step not committed; torchrun's agent
stopping the survivors), recovery (the death to the end of the first step that counted after
it: elastic's first committed step, torchft's first committed step on 3 replicas, torchrun's
first step after every worker restarted and loaded the checkpoint), the steady step (steps 1
to kill-step - 1, medians, without the fault-tolerance part) and that part per step (elastic's
commit; torchft's quorum and should_commit; torchrun's DCP save), and the death to the end of
the first step at 4 workers again. The workers are bench/elastic_peers_job.py.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from . import elastic_chaos

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_peers_job.py")
WORKERS = 4
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _events(out: str) -> list[dict[str, Any]]:
    evs = []
    for name in os.listdir(out):
        if name.startswith("events") and name.endswith(".jsonl"):
            rank = int(name[6:-6])
            with open(os.path.join(out, name)) as f:
                evs += [dict(json.loads(line), rank=rank) for line in f if line.strip()]
    return sorted(evs, key=lambda e: e["t"])


def _env() -> dict[str, str]:
    from mpicomm import clean_env

    env = clean_env()
    env["PYTHONPATH"] = elastic_chaos.ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env | LOOPBACK


def run_ours_growing(cfg: dict, out: str, timeout: float) -> str | None:
    return run_ours(cfg | {"grow": True}, out, timeout)


def run_ours_spare(cfg: dict, out: str, timeout: float) -> str | None:
    return run_ours(cfg | {"grow": "spare"}, out, timeout)


def run_ours(cfg: dict, out: str, timeout: float) -> str | None:
    rc, output, _ = elastic_chaos.launch([JOB, "ours", json.dumps(cfg), out], WORKERS, timeout, tag=out)
    return None if rc is not None else f"timed out: {output[-800:]}"     # (the victim's exit makes rc non-zero)


def run_torchft(cfg: dict, out: str, timeout: float) -> str | None:
    try:
        os.environ.setdefault("RUST_LOG", "warn")      # the lighthouse logs every quorum otherwise
        from torchft.coordination import LighthouseServer
    except ImportError:
        return "skipped: torchft is not installed (pip install torchft==0.2.0 torch==2.13.0)"
    # min_replicas 3: with 2, the replicas (arriving at different moments) trained in quorums of 2;
    # join timeout 10 s (torchft's Slurm example): at its default, 60 s, a quorum without a replica
    # that died inside a step timed out in every survivor (the Manager's quorum timeout is 60 s too)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=WORKERS - 1, join_timeout_ms=cfg["torchft_join_ms"])
    try:
        procs = [subprocess.Popen([sys.executable, JOB, "torchft", json.dumps(cfg), out, str(r), lighthouse.address()],
                                  env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(WORKERS)]
        deadline = time.monotonic() + timeout
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                return "timed out"
        bad = [(r, p.returncode) for r, p in enumerate(procs) if r != 1 and p.returncode != 0]
        return None if not bad else f"exit statuses {bad}: {outs[bad[0][0]][-800:]}"
    finally:
        lighthouse.shutdown()


def run_torchrun(cfg: dict, out: str, timeout: float) -> str | None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORKERS}",
           "--max-restarts=1", JOB, "torchrun", json.dumps(cfg), out]
    try:
        p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timed out"
    return None if p.returncode == 0 else f"exit status {p.returncode}: {p.stderr[-800:]}"


def measure(evs: list[dict[str, Any]], kill_step: int) -> dict[str, float]:
    """Detection, recovery, the steady step and its fault-tolerance part, from a run's events."""
    death = next(e["t"] for e in evs if e["ev"] == "death")
    steady = [e for e in evs if e["ev"] == "step" and e["step"] >= 1 and e["t1"] < death and e["world"] >= WORKERS - 1]
    seen = [e.get("at", e["t"]) for e in evs if e["ev"] in ("failed", "term") and e.get("at", e["t"]) >= death]
    detect = min(seen) if seen else float("nan")
    # (torchft: a victim dead between steps is left out of the next quorum; no step fails, detect is nan)
    after = [e for e in evs if e["ev"] == "step" and e["counted"] and e["t0"] > death and (not seen or e["t0"] >= detect)]
    first = min(e["t1"] for e in after) if after else float("nan")
    full = [e["t1"] for e in after if e["world"] == WORKERS]
    compute = statistics.median(e["t1"] - e["t0"] - e["ft_s"] for e in steady)
    ft = statistics.median(e["ft_s"] for e in steady)
    return {"detect_s": detect - death, "recover_s": first - death, "step_s": compute, "ft_s": ft,
            "world_after": after[0]["world"] if after else 0, "full_s": min(full) - death if full else float("nan")}


def main(args: Any) -> int:
    """``bench elastic --peers``."""
    cfg = {"params": args.params, "width": args.width, "batch": args.batch, "steps": args.peers_steps,
           "kill_step": args.kill_step, "workers": WORKERS, "ours": args.peers_ours, "kill_at": args.peers_kill_at,
           "torchft_join_ms": args.peers_torchft_join_ms}
    if not 2 <= args.kill_step < args.peers_steps - 1:
        print(f"bench elastic --peers: expected 2 <= --kill-step < --peers-steps - 1, got {args.kill_step}",
              file=sys.stderr)
        return 2
    n = sum(p.numel() for p in __import__("bench.elastic", fromlist=["make_model"]).make_model(
        args.params, args.width).parameters())
    print(f"# bench elastic --peers: {WORKERS} workers, {n / 1e6:.1f}M-parameter MLP, Adam, batch {args.batch} "
          f"per worker, worker 1 killed at the {args.peers_kill_at} of step {args.kill_step} of {args.peers_steps}; "
          "loopback only")
    print("# detect s: the death to the survivors seeing it; recover s: the death to the end of the first step "
          "that counted after it; step s: a steady step without the FT part; FT part: per step (elastic: "
          "commit; torchft: quorum + should_commit; torchrun: DCP save), its share of a step; "
          f"{WORKERS} again s: the death to the end of the first step at {WORKERS} workers")
    print(f"{'system':<30}{'detect s':>10}{'recover s':>11}{'step s':>9}{'FT part s':>11}{'FT/step':>9}"
          f"{'workers after':>15}{f'{WORKERS} again s':>12}")
    why = elastic_chaos.ulfm_missing(elastic_chaos.mpiexec())
    systems = [(f"elastic ({args.peers_ours})", run_ours if why is None else None),
               (f"elastic ({args.peers_ours}, grows back)", run_ours_growing if why is None else None),
               (f"elastic ({args.peers_ours}, a spare)", run_ours_spare if why is None else None),
               ("torchft 0.2", run_torchft), ("torchrun + DCP", run_torchrun)]
    systems = [(n, f) for n, f in systems if any(n.startswith(w) for w in args.peers_systems.split(","))]
    for name, fn in systems:
        out = tempfile.mkdtemp(prefix="peers-")
        try:
            err = f"skipped: no ULFM ({why})" if fn is None else fn(cfg, out, args.trial_timeout + 120)
            evs = _events(out)
            if err is None or any(e["ev"] == "death" for e in evs) and any(e["ev"] == "step" and e["t0"] > next(
                    x["t"] for x in evs if x["ev"] == "death") for e in evs):
                m = measure(evs, args.kill_step)
                again = "-" if m["full_s"] != m["full_s"] else f"{m['full_s']:.3f}"
                print(f"{name:<30}{m['detect_s']:>10.3f}{m['recover_s']:>11.3f}{m['step_s']:>9.3f}{m['ft_s']:>11.3f}"
                      f"{m['ft_s'] / m['step_s']:>9.1%}{m['world_after']:>15}{again:>12}" + (f"   ({err})" if err else ""),
                      flush=True)
            else:
                print(f"{name:<30} {err}", flush=True)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    return 0
