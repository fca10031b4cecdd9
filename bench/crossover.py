"""Crossover finder: from which message size is the 1-bit allreduce faster than fp32 here?

``python -m bench compressed --crossover [--rates 100mbit,1gbit,10gbit] [--sizes 16K,64K,...,16M]
[--ranks 2] [--json F] [--plot F.png]``

It times the fp32 allreduce against each 1-bit API (``all_reduce:1bit``: ``MpiBackend``,
DeepSpeed's signature; ``all_reduce:1bit-ar``: ``OnebitAllreduce``) over message sizes, in one
``bench compressed`` run per setting:

- ``local``: this machine's MPI as ``mpiexec -n RANKS`` gives it (shared memory on one host;
  run it under your cluster's launcher instead, ``mpiexec ... python -m bench compressed
  --crossover``, to measure your network: then only that setting is measured);
- ``netsim R`` for each rate R of ``--rates`` (``bench netsim --hosts 2``: two simulated hosts
  joined by links of that rate), where netsim can run (root, ip, tc); else a line says why not.

For each setting and API it prints ``crossover: 1-bit faster from N bytes at R`` (the smallest
measured size from which 1-bit is faster at that size and every larger one) or ``crossover:
1-bit never faster ... at R``, writes every record with its setting to ``--json`` and draws
time against size, one panel per setting, to ``--plot``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Sequence

__all__ = ["APIS", "OPS", "crossover", "summarize", "lines", "draw", "run"]

#: The 1-bit rows and the API each one times.
APIS = {"all_reduce:1bit": "MpiBackend", "all_reduce:1bit-ar": "OnebitAllreduce"}
OPS = ("all_reduce", *APIS)
DEFAULT_SIZES = "16K,64K,256K,1M,4M,16M"


def crossover(sizes: Sequence[int], fp32: Sequence[float], onebit: Sequence[float]) -> int | None:
    """The smallest size from which ``onebit`` time is below ``fp32`` at it and every larger
    size (sizes ascending, times per size), or None when 1-bit is not faster at the largest."""
    found = None
    for s, f, o in sorted(zip(sizes, fp32, onebit), reverse=True):
        if o < f:
            found = s
        else:
            break
    return found


def summarize(records: list[dict]) -> list[dict]:
    """One result per (setting, API): its sizes, both times and the crossover size."""
    by: dict[tuple[str, str], dict[int, float]] = {}
    for rec in records:
        by.setdefault((rec["setting"], rec["op"]), {})[int(rec["size_bytes"])] = float(rec["time_us_mean"])
    out = []
    for setting in dict.fromkeys(rec["setting"] for rec in records):
        base = by.get((setting, "all_reduce"), {})
        for op, api in APIS.items():
            mine = by.get((setting, op), {})
            sizes = sorted(set(base) & set(mine))
            if not sizes:
                continue
            out.append({"setting": setting, "op": op, "api": api, "sizes": sizes,
                        "fp32_us": [base[s] for s in sizes], "onebit_us": [mine[s] for s in sizes],
                        "crossover_bytes": crossover(sizes, [base[s] for s in sizes],
                                                     [mine[s] for s in sizes])})
    return out


def lines(results: list[dict]) -> list[str]:
    """The printed verdicts, one per (setting, API)."""
    text = []
    for r in results:
        if r["crossover_bytes"] is None:
            text.append(f"crossover: 1-bit never faster (up to {r['sizes'][-1]} bytes) at "
                        f"{r['setting']} [{r['api']}]")
        else:
            text.append(f"crossover: 1-bit faster from {r['crossover_bytes']} bytes at "
                        f"{r['setting']} [{r['api']}]")
    return text


def draw(results: list[dict], path: str) -> None:
    """Time per call against size, one panel per setting: fp32 and each 1-bit API, crossovers marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plot import size_label

    settings = list(dict.fromkeys(r["setting"] for r in results))
    cols = min(2, len(settings))
    rows = -(-len(settings) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 3.6 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(settings):]:
        ax.set_visible(False)
    for ax, setting in zip(flat, settings):
        mine = [r for r in results if r["setting"] == setting]
        ax.plot(mine[0]["sizes"], mine[0]["fp32_us"], "o-", color="black", label="fp32 all_reduce")
        for r, colour in zip(mine, ("tab:blue", "tab:orange")):
            ax.plot(r["sizes"], r["onebit_us"], "s--", color=colour, label=f"1-bit {r['api']}")
            if r["crossover_bytes"] is not None:
                ax.axvline(r["crossover_bytes"], color=colour, alpha=0.4, lw=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = mine[0]["sizes"][::max(1, len(mine[0]["sizes"]) // 4)]
        ax.set_xticks(ticks, [size_label(t) for t in ticks])
        ax.set_title(setting, fontsize=9)
        ax.set_xlabel("message size per rank")
        ax.grid(True, which="both", alpha=0.3)
    for row in axes:
        row[0].set_ylabel("time per call (us), lower is better")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("1-bit vs fp32 allreduce (vertical band: 1-bit faster from there on)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# running the settings

def _bench_args(args, json_path: str) -> list[str]:
    """``bench compressed`` arguments of one setting's run (without the program name)."""
    out = ["--ops", ",".join(OPS), "--sizes", args.crossover_sizes,
           "--rounds", str(args.rounds), "--json", json_path]
    for flag, value in (("--iters", args.iters), ("--warmup", args.warmup)):
        if value is not None:
            out += [flag, str(value)]
    if args.budget is not None:
        out += ["--budget", str(args.budget)]
    if args.no_check:
        out.append("--no-check")
    return out


def _local_command(ranks: int, bench_args: list[str]) -> tuple[list[str], dict]:
    from .netsim import _find_mpiexec, mpi_flavour

    mpiexec = _find_mpiexec()
    env = dict(os.environ)
    extra = []
    if mpi_flavour(mpiexec) == "openmpi":
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        if ranks > (os.cpu_count() or 1):
            extra = ["--oversubscribe"]
    return [mpiexec, "-n", str(ranks), *extra, sys.executable, "-m", "mpi4py", "-m", "bench",
            "compressed", *bench_args], env


def _records(path: str, setting: str) -> list[dict]:
    with open(path) as f:
        recs = json.load(f)["records"]
    return [dict(r, setting=setting) for r in recs if r.get("op") in OPS]


def run(args, world, measure) -> int:
    """The --crossover program: measure every setting, print verdicts, write JSON and plot.

    ``measure(argv) -> int`` is ``bench compressed``'s main, run in place under the user's mpiexec."""
    from . import netsim

    records: list[dict] = []
    notes: list[str] = []
    rc = 0
    rates = [r.strip() for r in (args.rates or "").split(",") if r.strip()]
    for r in rates:
        netsim.parse_rate(r)  # ValueError before anything runs
    if world.Get_size() > 1:  # launched by the user's mpiexec: measure this network only
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "local.json") if world.Get_rank() == 0 else os.devnull
            path = world.bcast(path)
            rc = measure(_bench_args(args, path))
            if world.Get_rank() == 0:
                records += _records(path, "local")
        if rates:
            notes.append("netsim rates skipped: under mpiexec only this network is measured "
                         "(run python -m bench compressed --crossover without mpiexec for netsim)")
        if world.Get_rank() != 0:
            return rc
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "local.json")
            cmd, env = _local_command(args.ranks, _bench_args(args, path))
            print(f"# crossover: local, {args.ranks} ranks: {' '.join(cmd[:3])} ...", flush=True)
            rc = subprocess.run(cmd, env=env).returncode
            if rc == 0:
                records += _records(path, "local")
            problem = netsim.preflight() if rates else None
            if problem:
                notes.append(f"netsim rates skipped: {problem}")
            else:
                for rate in rates:
                    path = os.path.join(tmp, f"netsim-{rate}.json")
                    cmd = [sys.executable, "-m", "bench", "netsim", "--hosts", "2", "--rate", rate,
                           "--", "compressed", *_bench_args(args, path)]
                    print(f"# crossover: netsim {rate}", flush=True)
                    code = subprocess.run(cmd).returncode
                    if code == 0:
                        records += _records(path, f"netsim {rate}")
                    else:
                        rc = rc or code
                        notes.append(f"netsim {rate}: the run failed (exit {code})")
    results = summarize(records)
    for line in notes:
        print(f"# {line}")
    for line in lines(results):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "compressed-crossover", "results": results, "records": records,
                       "notes": notes}, f, indent=1)
    if args.plot and results:
        from .plot import matplotlib_missing
        missing = matplotlib_missing()
        if missing:
            print(f"# --plot: {missing}", file=sys.stderr)
        else:
            draw(results, args.plot)
            print(f"# plot: {args.plot}")
    return rc
