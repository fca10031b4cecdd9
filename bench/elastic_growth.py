"""Growth: how long a replacement takes to join the job, split into elastic's part and the
replacement's own start-up, beside a bare torch process's start-up measured in the same run.

    python -m bench elastic --growth 3

Each of the N rounds runs, in turn: the floor, a fresh ``python -c`` that imports torch and builds
a ``torch.optim.Adam`` (whose constructor imports ``torch._dynamo``), alone on the machine: what
any process that trains pays before it can take part, a replacement included; then two
``mpirun --with-ft ulfm -n 4`` jobs of bench/elastic_soak_job.py (ZeroOptimizer stage 2, growth
on), each with rank 1 SIGKILLed 10 s into training, one training on while the replacement starts
(``elastic.run``'s default) and one waiting for it at the recovery (``wait_for_replacements``);
with ``--soak-spare`` a third, ``elastic.run(spare=True)``, rank 1 killed 20 s into training:
the spare starts at the job's first commit, ahead of the loss, its imports at nice 10 beside the 4
training ranks (its start-up is then not part of the growth: grow s runs from the end of the
recovery; where the spare is not ready by then, grow s includes the rest of its start-up).
Prints, per growth (``state.growths``): spawn s (the survivors' ``MPI_Comm_spawn`` and merge),
start-up s (the spawn to the replacement's ready message, noticed at a commit: its Python, MPI,
torch and the program up to ``elastic.run``), join s (the ready message to the grown world's
first commit: the state handed over), and grow s, their sum: the decision to spawn to the first
step at full size.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
from typing import Any

from . import elastic_chaos
from .elastic_soak import soak_run

#: Seconds into training at which rank 1 is killed; the window ends just before a second kill.
KILL_AT = 10.0
FLOOR = ("import time; t1 = time.time(); import torch; t2 = time.time(); "
         "torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]); print(t1, t2, time.time())")


def floor() -> tuple[float, float, float]:
    """A fresh interpreter's start-up to a built torch optimizer, alone: (seconds from the start of
    the process to the optimizer built, of them ``import torch``, and the first ``torch.optim.Adam``)."""
    import time

    t0 = time.time()        # (one host: the child's wall clock is this one)
    out = subprocess.run([sys.executable, "-c", FLOOR], capture_output=True, text=True, check=True)
    t1, t2, t3 = (float(x) for x in out.stdout.split())
    return t3 - t0, t2 - t1, t3 - t2


def growths(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The growths an original rank (not a replacement) of ``soak_run``'s results recorded."""
    olds = [r for r in res["ranks"].values() if not r.get("newcomer", False)]
    return list(olds[0].get("growths", [])) if olds else []


def split(g: dict[str, Any]) -> tuple[float, float, float, float]:
    """A growth record as (spawn s, replacement start-up s, join s, grow s); a spare's start-up
    came before the loss (nan), its grow s runs from the end of the recovery."""
    if g.get("spare"):
        return g["spawn_s"], float("nan"), g["join_s"], g["grow_s"]
    return g["spawn_s"], g["ready_s"] - g["spawn_s"], g["grow_s"] - g["ready_s"], g["grow_s"]


def main(args: Any) -> int:
    """``bench elastic --growth N``."""
    why = elastic_chaos.ulfm_missing(elastic_chaos.mpiexec())
    if why:
        print(f"bench elastic --growth: needs Open MPI with ULFM: {why}", file=sys.stderr)
        return 2
    if args.growth <= 0:
        print(f"bench elastic --growth: expected a number of rounds > 0, got {args.growth}", file=sys.stderr)
        return 2
    cfg = {"mode": "zero2", "seconds": 2 * KILL_AT - 0.5, "kill_every": KILL_AT, "width": args.soak_width,
           "layers": args.soak_layers, "batch": args.soak_batch, "grow": True}
    print(f"# bench elastic --growth {args.growth}: 4 ranks, zero2, MLP {args.soak_layers}x{args.soak_width}, rank 1 "
          f"SIGKILLed {KILL_AT:g} s into training; elastic.run(max_world_size=4); per growth: spawn s, the "
          "replacement's start-up s (to its ready message), join s (to the first commit at 4), grow s (all)")
    print("# floor: a fresh `python -c` importing torch and building a torch.optim.Adam, alone: its start to the "
          "optimizer built (s), of which torch's import and the Adam (most of it the import of torch._dynamo)")
    if args.soak_spare:
        print(f"# spare: elastic.run(max_world_size=4, spare=True), rank 1 SIGKILLed {2 * KILL_AT:g} s into training; "
              "the spare started at the first commit (start-up: nan), grow s from the end of the recovery")
    print(f"{'round':<7}{'run':<14}{'spawn s':>9}{'start-up s':>12}{'join s':>8}{'grow s':>8}")
    runs = [("trains on", {"join_wait": False}), ("waits", {"join_wait": True})]
    if args.soak_spare:
        runs.append(("spare", {"join_wait": False, "spare": True, "seconds": 4 * KILL_AT - 0.5,
                               "kill_every": 2 * KILL_AT}))
    rows: dict[str, list[tuple[float, ...]]] = {"floor": [], **{name: [] for name, _ in runs}}
    for i in range(args.growth):
        f = floor()
        rows["floor"].append(f)
        print(f"{i:<7}{'floor':<14}{'':>9}{f[0]:>12.2f}{'':>8}{'':>8}   (torch {f[1]:.2f} s, Adam {f[2]:.2f} s)", flush=True)
        for name, extra in runs:
            res = soak_run(cfg | extra, timeout=4 * KILL_AT + 240)
            done = [g for g in growths(res) if g.get("note") is None]
            if not done:
                notes = [g.get("note") for g in growths(res)] or ["no growth recorded"]
                print(f"{i:<7}{name:<14}  no replacement joined ({'; '.join(map(str, notes))}; exit status "
                      f"{res['rc']})\n{res['output'][-1500:]}", flush=True)
                continue
            for g in done:
                s = split(g)
                rows[name].append(s)
                print(f"{i:<7}{name:<14}{s[0]:>9.2f}{s[1]:>12.2f}{s[2]:>8.2f}{s[3]:>8.2f}", flush=True)
    print("# medians")
    for name, got in rows.items():
        if not got:
            continue
        med = [statistics.median(col) for col in zip(*got)]
        if name == "floor":
            print(f"{'':<7}{name:<14}{'':>9}{med[0]:>12.2f}{'':>8}{'':>8}   (torch {med[1]:.2f} s, Adam {med[2]:.2f} s)")
        else:
            print(f"{'':<7}{name:<14}{med[0]:>9.2f}{med[1]:>12.2f}{med[2]:>8.2f}{med[3]:>8.2f}")
    return 0
