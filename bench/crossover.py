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
1-bit never faster ... at R``, and reports through the one ``Reporter``: ``--json`` gets every
measurement record with its setting, then one ``crossover`` record per (setting, API)
(``bench/README.md``), ``--plot`` time against size, one panel per setting
(``bench.plot.plot_crossover``; ``bench plot`` draws the same from the file).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Sequence

from . import netsim
from .reporting import Reporter

__all__ = ["APIS", "OPS", "crossover", "summarize", "lines", "run"]

#: The 1-bit rows and the API each one times.
APIS = {"all_reduce:1bit": "MpiBackend", "all_reduce:1bit-ar": "OnebitAllreduce"}
OPS = ("all_reduce", *APIS)
BENCH = "compressed"
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
    """One ``crossover`` record per (setting, API): its sizes, both times and the crossover size
    (the envelope from the setting's fp32 records; ``wrong`` 0: the measurements carry theirs)."""
    by: dict[tuple[str, str], dict[int, float]] = {}
    for rec in records:
        by.setdefault((rec["setting"], rec["op"]), {})[int(rec["size_bytes"])] = float(rec["time_us_mean"])
    out = []
    for setting in dict.fromkeys(rec["setting"] for rec in records):
        base = by.get((setting, "all_reduce"), {})
        first = next(r for r in records if r["setting"] == setting)
        for op, api in APIS.items():
            mine = by.get((setting, op), {})
            sizes = sorted(set(base) & set(mine))
            if not sizes:
                continue
            out.append({"bench": BENCH, "op": "crossover", "ranks": first.get("ranks"),
                        "hosts": first.get("hosts"), "network": first.get("network"), "wrong": 0,
                        "setting": setting, "onebit_op": op, "api": api, "sizes": sizes,
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
    mpiexec = netsim._find_mpiexec()
    env = dict(os.environ)
    extra = []
    if netsim.mpi_flavour(mpiexec) == "openmpi":
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
    rates = [r.strip() for r in (args.rates or "").split(",") if r.strip()]
    for r in rates:
        netsim.parse_rate(r)  # ValueError before anything runs
    launched = world.Get_size() > 1  # by the user's mpiexec: measure this network only
    settings = ([f"local ({world.Get_size()} ranks of this launch)"] if launched else
                [f"local ({args.ranks} ranks)"] + [f"netsim {rate} (2 hosts)" for rate in rates])
    rep = Reporter(BENCH, world, args, columns=())
    rep.start(dtype="float32", extra=[
        "crossover: fp32 all_reduce against " + ", ".join(f"{op} ({api})" for op, api in APIS.items())
        + f" at sizes {args.crossover_sizes}; settings: {', '.join(settings)}"])
    if launched:
        rc, notes = _measure_launched(args, world, measure, rates, rep)
        if world.Get_rank() != 0:
            return rc
    else:
        rc, notes = _measure_here(args, rates, rep)
    for rec in summarize(rep.records):
        rep.emit(rec, show=False)
    for line in notes:
        rep.note(line)
    for line in lines([r for r in rep.records if r["op"] == "crossover"]):
        rep.line(line)
    verdict = rep.finish(title="1-bit vs fp32 allreduce (vertical band: 1-bit faster from there on)")
    return rc or verdict


def _measure_launched(args, world, measure, rates: list[str], rep: Reporter) -> tuple[int, list[str]]:
    """Collective: the local setting measured in place; rank 0 emits its records."""
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "local.json") if world.Get_rank() == 0 else os.devnull
        path = world.bcast(path)
        rc = measure(_bench_args(args, path))
        if world.Get_rank() == 0:
            for rec in _records(path, "local"):
                rep.emit(rec, show=False)
    if rates:
        notes.append("netsim rates skipped: under mpiexec only this network is measured "
                     "(run python -m bench compressed --crossover without mpiexec for netsim)")
    return rc, notes


def _measure_here(args, rates: list[str], rep: Reporter) -> tuple[int, list[str]]:
    """Every setting in its own job started from here: local, then netsim at each rate."""
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "local.json")
        cmd, env = _local_command(args.ranks, _bench_args(args, path))
        rep.note(f"crossover: local, {args.ranks} ranks: {' '.join(cmd[:3])} ...")
        rc = subprocess.run(cmd, env=env).returncode
        if rc == 0:
            for rec in _records(path, "local"):
                rep.emit(rec, show=False)
        problem = netsim.preflight() if rates else None
        if problem:
            notes.append(f"netsim rates skipped: {problem}")
            rates = []
        for rate in rates:
            path = os.path.join(tmp, f"netsim-{rate}.json")
            cmd = [sys.executable, "-m", "bench", "netsim", "--hosts", "2", "--rate", rate,
                   "--", "compressed", *_bench_args(args, path)]
            rep.note(f"crossover: netsim {rate}")
            code = subprocess.run(cmd).returncode
            if code == 0:
                for rec in _records(path, f"netsim {rate}"):
                    rep.emit(rec, show=False)
            else:
                rc = rc or code
                notes.append(f"netsim {rate}: the run failed (exit {code})")
    return rc, notes
