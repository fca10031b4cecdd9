"""Soak: training at 4 ranks for a while with a rank killed every few seconds, beside the same
training losing nothing, in one run.

    python -m bench elastic --soak 120 --kill-every 30

Run as one process: two ``mpirun --with-ft ulfm -n 4`` jobs of bench/elastic_soak_job.py, the one
without failures first (``--soak-spare``: a third, the kills with ``elastic.run(spare=True)``). Prints, per run: the ranks at the start and the end, the ranks killed,
the steps done in the training time, steps per second and their ratio to the run without
failures, the recoveries and their mean time in ``elastic.recover``, the newcomers that joined
(growth) and the mean time of a growth (the spawn to the grown world's first commit,
``state.growths``), and the largest
difference of every survivor's final weights from one plain torch process on the same global
batches (the run without failures shows the rounding this length of training gives). Then the
training time each run lost against the failure-free step rate, from its steps per 0.25 s: in
the 5 s after each kill (the recovery, the replacement starting and joining), and elsewhere (in
the run without failures: the machine's noise). Without growth (``elastic.run`` taking no
``max_world_size``) the job only shrinks: nobody is killed below 2 ranks.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any

import numpy as np

from . import elastic_chaos
from .elastic_soak_job import growth, reference

#: Seconds from a kill within which lost time counts as the failure's (the recovery, the growth).
AFTER = 5.0
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_soak_job.py")


def soak_run(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One job of ``cfg``: its survivors' results (rank -> json, weights) and exit status."""
    out = tempfile.mkdtemp(prefix="soak-")
    try:
        rc, output, wall = elastic_chaos.launch([JOB, json.dumps(cfg), out], 4, timeout, tag=out)
        timelines = []      # every process's steps per bin: the victims' (written as they died), the survivors'
        for name in sorted(os.listdir(out)):
            if name.startswith("timeline-"):
                with open(os.path.join(out, name)) as f:
                    timelines.append(json.load(f))
        ranks = {}
        for r in range(4):
            path = os.path.join(out, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks[r] = json.load(f)
                ranks[r]["weights"] = dict(np.load(os.path.join(out, f"rank{r}.npz")))
                timelines.append(ranks[r]["timeline"])
        kills = sum(name.startswith("timeline-") for name in os.listdir(out))     # a victim writes one as it dies
        return {"rc": rc, "ranks": ranks, "wall_s": wall, "output": output, "timeline": chain(timelines), "kills": kills}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def chain(timelines: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's steps per bin from its processes' timelines (each: ``bin_s`` and steps per bin
    while it trained): in each bin, the process that started training first among those that
    trained through it, of those the one that trained longest (the ranks step together; a
    victim's last bin ends at its death)."""
    spans = []
    for t in timelines:
        steps = {int(b): int(n) for b, n in t["steps"].items()}
        if steps:
            spans.append((min(steps), max(steps), steps))
    spans.sort(key=lambda s: (s[0], -s[1]))
    job: dict[str, int] = {}
    for b in range(max((s[1] for s in spans), default=-1) + 1):
        for first, last, steps in spans:
            if first <= b <= last:
                job[str(b)] = steps.get(b, 0)
                break
    return {"bin_s": timelines[0]["bin_s"] if timelines else 0.25, "steps": job}


def lost_seconds(timeline: dict[str, Any], seconds: float, rate: float, kill_every: float,
                 after: float) -> tuple[float, float]:
    """Training time lost against ``rate`` steps/s, from a step timeline (``chain``'s: steps per bin of
    ``bin_s`` seconds since the common start): in the ``after`` seconds from each kill (every
    ``kill_every`` s), and elsewhere. A bin that stepped faster than ``rate`` makes up for nothing."""
    width = float(timeline["bin_s"])
    steps = {int(b): int(n) for b, n in timeline["steps"].items()}
    near = rest = 0.0
    for b in range(int(seconds // width)):      # whole bins of the window only
        lost = max(0.0, width - steps.get(b, 0) / rate)
        t = b * width
        if kill_every > 0 and t >= kill_every and t % kill_every < after:
            near += lost
        else:
            rest += lost
    return near, rest


def _row(name: str, cfg: dict[str, Any], res: dict[str, Any], base_rate: float | None) -> tuple[str, float | None]:
    if not res["ranks"]:
        tail = res["output"][-1500:]
        return f"{name:<12} no survivor finished (exit status {res['rc']}; None: timed out)\n{tail}", None
    # the longest-lived rank (every rank's seconds are the common window; a newcomer saw only
    # the recoveries and growths after its join)
    def lived(r: dict[str, Any]) -> tuple[bool, int]:
        return not r.get("newcomer", False), len(r["recoveries"]) + len(r.get("growths", []))
    first = max(res["ranks"].values(), key=lived)
    steps, secs = first["steps"], first["seconds"]
    rate = steps / secs
    want = reference(cfg, steps)
    diff = max(float(np.abs(r["weights"][f"p{i}"] - w).max()) for r in res["ranks"].values() for i, w in enumerate(want))
    same = all(r["steps"] == steps for r in res["ranks"].values())
    recs = first["recoveries"]
    rec_s = sum(r["recover_s"] for r in recs) / len(recs) if recs else 0.0
    grows = [g["grow_s"] for g in first.get("growths", []) if g.get("note") is None]
    grow_s = f"{sum(grows) / len(grows):.2f}" if grows else "-"
    ratio = "" if base_rate is None else f"{rate / base_rate:.1%}"
    line = (f"{name:<12}{'4->' + str(first['world_size']):>8}{res['kills']:>6}{steps:>8}{secs:>9.1f}{rate:>10.2f}{ratio:>8}"
            f"{len(recs):>6}{sum(r.get('newcomer', False) for r in res['ranks'].values()):>5}{rec_s:>10.3f}{grow_s:>8}{diff:>12.2e}{'' if same else '  (survivors differ in steps!)':>4}")
    return line, rate


def _losses(rows: list[tuple[str, dict[str, Any], float]], rate: float) -> None:
    """Print where each run's time went against the failure-free mean ``rate``: rows of (name,
    ``soak_run``'s results, seconds between kills or 0)."""
    after = min([AFTER] + [k for _, _, k in rows if k > 0])
    print(f"# time lost against {rate:.2f} steps/s (the run without failures), from the job's "
          f"steps per {rows[0][1]['timeline']['bin_s']:g} s (a bin above the rate makes up for nothing, so "
          f"the run without failures shows the machine's noise): in the {after:g} s from each kill / elsewhere")
    for name, res, kill_every in rows:
        seconds = max(r["seconds"] for r in res["ranks"].values())
        near, rest = lost_seconds(res["timeline"], seconds, rate, kill_every, after)
        print(f"#   {name:<12}{near:>8.1f} s /{rest:>7.1f} s of {seconds:.0f} s")


def main(args: Any) -> int:
    """``bench elastic --soak SECONDS --kill-every S``."""
    why = elastic_chaos.ulfm_missing(elastic_chaos.mpiexec())
    if why:
        print(f"bench elastic --soak: needs Open MPI with ULFM: {why}", file=sys.stderr)
        return 2
    if args.soak <= 0 or args.kill_every <= 0:
        print("bench elastic --soak: expected --soak SECONDS > 0 and --kill-every S > 0", file=sys.stderr)
        return 2
    mode = args.soak_mode
    cfg = {"mode": mode, "seconds": args.soak, "width": args.soak_width, "layers": args.soak_layers,
           "batch": args.soak_batch, "grow": not args.soak_no_grow, "join_wait": args.soak_join_wait}
    grows = growth() and not args.soak_no_grow
    print(f"# bench elastic --soak {args.soak:g} --kill-every {args.kill_every:g}: 4 ranks, {mode}, MLP "
          f"{args.soak_layers}x{args.soak_width}, global batch {args.soak_batch}, Adam, commit every step; "
          + (f"growth: elastic.run(max_world_size=4, wait_for_replacements={args.soak_join_wait})"
             + ("; +spare: the same kills, and spare=True" if args.soak_spare else "") if grows else
             "no growth (--soak-no-grow, or elastic.run takes no max_world_size): shrinks, nobody killed below 2 ranks"))
    print("# max |w - ref|: every survivor's final weights against one plain torch process, same steps")
    print(f"{'run':<12}{'ranks':>8}{'kills':>6}{'steps':>8}{'train s':>9}{'steps/s':>10}{'ratio':>8}{'recov':>6}{'new':>5}"
          f"{'recover s':>10}{'grow s':>8}{'max |w-ref|':>12}")
    timeout = args.soak + 240
    base = soak_run(cfg | {"kill_every": 0}, timeout)
    line, rate = _row("no failures", cfg, base, None)
    print(line, flush=True)
    rows = [("no failures", base, 0.0)]
    for name, extra in ((f"kill/{args.kill_every:g}s", {}), ("+spare", {"spare": True})):
        if extra and not args.soak_spare:
            continue
        chaos = soak_run(cfg | {"kill_every": args.kill_every} | extra, timeout)
        line, _ = _row(name, cfg, chaos, rate)
        print(line, flush=True)
        if chaos["ranks"]:
            rows.append((name, chaos, args.kill_every))
    if rate is not None and len(rows) > 1:
        _losses(rows, rate)
    return 0
