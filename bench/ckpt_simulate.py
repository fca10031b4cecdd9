"""``python -m bench ckpt --simulate-ranks N``: ckpt's save and load planning for an N-rank job, in
one process, beside torch DCP's planning of the same state.

Each sampled rank (first, middle, last) gets the metadata it would hold in a real job: a model of
the named shapes whose parameters (and AdamW's ``exp_avg`` / ``exp_avg_sq``) are DTensors with
meta-device local shards, on a device mesh of a fake process group of N ranks (no data, no MPI).
It then runs the planning steps ``ckpt.save`` and ``ckpt.load`` run on that rank (``ckpt.api``'s
own functions), fed what the collectives between them would deliver, synthesised for N ranks
(every rank's summary is the sampled rank's with its own process-group rank: a job whose ranks
agree). The root's work after the writes is the block checksums from the fixed-size reduction,
the manifest checks and its JSON. DCP: ``DefaultSavePlanner.create_local_plan`` on a sampled
rank, then ``create_global_plan`` over N local plans (built with DCP's own per-rank functions for
every rank), then ``DefaultLoadPlanner.create_local_plan`` against the metadata it made.

Before DCP's side is built at N ranks it is run at two small N to estimate its memory and time at
N; when that would not fit in MemAvailable (with a 1.5x margin) or would take over 1.5 x
--dcp-limit-s, it is declined in one line saying what it would need and the largest N that fits,
and ckpt's figures stand alone.

The modules: ``ckpt_sim_world`` (the simulated ranks' models, meshes and states), ``ckpt_sim_plan``
(ckpt's planning per rank, measured), ``ckpt_sim_dcp`` (DCP's planning and its estimate), and this
one, the command line.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

from bench import ckpt_sim_dcp as dcp
from bench.ckpt_sim_plan import (Measured, ckpt_load_rank, ckpt_root_commit, ckpt_save_rank, count_calls, measure,
                                 sample_ranks)
from bench.ckpt_sim_world import (CONFIG_KEYS, DCP_LAYOUTS, LAYOUTS, MODELS, TP_DIM0, TP_DIM1, FakeComm, llama_shapes,
                                  mesh_shape, parse_model, rank_state)

__all__ = ["main", "parse_model", "llama_shapes", "mesh_shape", "rank_state", "FakeComm", "Measured", "measure",
           "count_calls", "sample_ranks", "ckpt_save_rank", "ckpt_root_commit", "ckpt_load_rank", "MODELS", "LAYOUTS",
           "DCP_LAYOUTS", "TP_DIM0", "TP_DIM1"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench ckpt --simulate-ranks N", description=__doc__.splitlines()[0])
    p.add_argument("--simulate-ranks", type=int, required=True, metavar="N", help="ranks of the simulated save")
    p.add_argument("--load-ranks", type=int, default=None, metavar="M", help="ranks of the simulated load (default N)")
    p.add_argument("--model", default="llama-70b", help=f"{' or '.join(MODELS)} (default llama-70b), or "
                   + ",".join(k + "=INT" for k in CONFIG_KEYS))
    p.add_argument("--layout", choices=LAYOUTS, default="fsdp2",
                   help="fsdp2: dim-0 Shard over N; hsdp: Replicate x Shard(0) over (N / shard group, shard group); "
                        "fsdp2-tp: FSDP2 over N / TP size x tensor parallel over TP size (colwise q/k/v/gate/up/head, "
                        "rowwise o/down/embedding, norms replicated); zero1: replicated model, zero.ZeroOptimizer(AdamW, stage=1) over N")
    p.add_argument("--shard-group", type=int, default=8, help="hsdp: ranks that shard a replica (default 8)")
    p.add_argument("--tp-size", type=int, default=8, help="fsdp2-tp: ranks of a tensor-parallel group (default 8)")
    p.add_argument("--dcp", choices=("yes", "no"), default="yes", help="also time torch DCP's planning (default yes)")
    p.add_argument("--dcp-limit-s", type=float, default=600.0,
                   help="stop DCP's planning for a rank count once it takes longer than this (default 600)")
    p.add_argument("--json", default=None, help="write the figures as JSON to this file")
    return p


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 0 else "not measured (a second, traced run would take as long again)"


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from ckpt.manifest import DEFAULT_BLOCK_SIZE
    from ckpt.io import DEFAULT_CHUNK_BYTES

    n, m = args.simulate_ranks, args.load_ranks or args.simulate_ranks
    if n < 1 or m < 1:
        print("bench ckpt: expected --simulate-ranks and --load-ranks >= 1", flush=True)
        return 2
    args.group = args.tp_size if args.layout == "fsdp2-tp" else args.shard_group
    if args.dcp == "yes" and args.layout not in DCP_LAYOUTS:
        print(f"bench ckpt: --layout {args.layout}: torch DCP's planning is simulated for {' and '.join(DCP_LAYOUTS)} "
              "only (DCP saves no ZeroOptimizer; the simulated DCP plans take one mesh and placement for every "
              "tensor); pass --dcp no", flush=True)
        return 2
    if args.group < 1:
        print("bench ckpt: expected --shard-group and --tp-size >= 1", flush=True)
        return 2
    try:
        cfg = parse_model(args.model)
        mesh_shape(args.layout, n, args.group)
        mesh_shape(args.layout, m, args.group)
    except ValueError as exc:
        print(f"bench ckpt: {exc}", flush=True)
        return 2
    shapes = llama_shapes(cfg)
    nparams = sum(math.prod(s) for _, s in shapes)
    print(f"simulated ckpt planning: {args.model} ({len(shapes)} tensors, {nparams / 1e9:.2f}B parameters, fp32 + "
          f"AdamW), {args.layout}, save at {n} ranks, load at {m} ranks", flush=True)
    out: dict[str, Any] = {"model": args.model, "layout": args.layout, "save_ranks": n, "load_ranks": m,
                           "tensors": len(shapes), "parameters": nparams, "save": [], "load": []}
    block, chunk = DEFAULT_BLOCK_SIZE, DEFAULT_CHUNK_BYTES
    saved = None
    for r in sample_ranks(n):
        res = ckpt_save_rank(r, n, shapes, args.layout, args.group, block, chunk)
        saved = saved or res
        if res["summary"]["@table"] != saved["summary"]["@table"]:
            raise AssertionError(f"rank {r} planned another table than rank {saved['rank']}")
        nblocks = -(-int(res["manifest"].files["data.bin"]["nbytes"]) // block)
        print(f"  save rank {r:>6}: planning {res['seconds']:.3f} s, peak {_mib(res['peak_bytes'])}; "
              f"{len(res['items'])} write ranges in {res['rounds']} rounds; collectives per rank: summary "
              f"allgather {res['summary_bytes']} B sent, {res['summary_bytes'] * n:,} B received; checksum reduce "
              f"{nblocks * 12:,} B (a block's CRC part and byte count)", flush=True)
        out["save"].append({k: res[k] for k in ("rank", "seconds", "peak_bytes", "rounds", "pieces", "summary_bytes")}
                           | {"write_ranges": len(res["items"]), "checksum_reduce_bytes": nblocks * 12})
    root = ckpt_root_commit(saved["manifest"])
    text = root.value
    print(f"  root commit: {root.seconds:.3f} s, peak {_mib(root.peak_bytes)}; manifest {len(text):,} B "
          f"({_mib(len(text))}); data file {int(saved['manifest'].files['data.bin']['nbytes']) / 1e9:.1f} GB",
          flush=True)
    out["root"] = {"seconds": root.seconds, "peak_bytes": root.peak_bytes, "manifest_bytes": len(text)}
    for r in sample_ranks(m):
        res = ckpt_load_rank(r, m, text, shapes, args.layout, args.group, block, chunk)
        print(f"  load rank {r:>6} of {m}: planning {res['seconds']:.3f} s, peak {_mib(res['peak_bytes'])}; "
              f"{res['ranges']} byte ranges ({res['bytes'] / 1e9:.2f} GB) in {res['rounds']} rounds; manifest "
              f"broadcast {len(text):,} B; checksum reduce {res['checksum_reduce_bytes']:,} B (the CRCs of "
              f"{res['reported']} of its {res['dests']} tensors read; another rank reports the rest)",
              flush=True)
        out["load"].append({k: res[k] for k in ("rank", "seconds", "peak_bytes", "ranges", "rounds", "bytes",
                                                "checksum_reduce_bytes", "reported")})
    if args.dcp == "yes":
        out["dcp"] = _dcp(n, m, shapes, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _dcp(n: int, m: int, shapes, args) -> dict[str, Any]:
    """DCP's planning of the same state at n ranks (a rank's local plan, the coordinator's global
    plan over every rank's) and a load rank's local plan at m, within --dcp-limit-s; declined with
    a note when its estimate does not fit in memory or time."""
    limit = args.dcp_limit_s
    if n > max(dcp.CALIBRATION_RANKS):
        est = dcp.estimate(n, shapes, args.layout, args.group)
        note = dcp.decline(n, est, limit, step=args.group if args.layout == "hsdp" else 1)
        if note:
            print(note, flush=True)
            return {"finished": False, "declined": note.strip(), "limit_s": limit, "per_rank_kib": est.per_rank_kib,
                    "fixed_kib": est.fixed_kib, "estimated_global_s": est.global_s_at(n)}
    local = dcp.dcp_local_plan(0, n, shapes, args.layout, args.group)
    t0 = time.perf_counter()
    try:
        plans, g, gathered = dcp.save_pipeline(local.value, n, args.layout, args.group, t0 + limit)
    except TimeoutError:
        print(f"  DCP: making the {n} ranks' local plans took over --dcp-limit-s={limit:g} s; not timed", flush=True)
        return {"finished": False, "limit_s": limit, "local_s": local.seconds}
    del plans
    over = f" (over --dcp-limit-s={limit:g})" if g.seconds > limit else ""
    print(f"  DCP save: local plan {local.seconds:.3f} s (rank 0), peak {_mib(local.peak_bytes)}; create_global_plan "
          f"over {n} ranks {g.seconds:.3f} s{over}, peak {_mib(g.peak_bytes)}; local plans gathered at the "
          f"coordinator {gathered:,} B", flush=True)
    res: dict[str, Any] = {"finished": g.seconds <= limit, "limit_s": limit, "local_s": local.seconds,
                           "global_s": g.seconds, "global_peak_bytes": g.peak_bytes, "gathered_bytes": gathered}
    _global, metadata = g.value
    ld = dcp.dcp_local_plan(m // 2, m, shapes, args.layout, args.group, metadata)
    print(f"  DCP load: local plan of rank {m // 2} of {m} {ld.seconds:.3f} s, peak {_mib(ld.peak_bytes)}", flush=True)
    res["load_local_s"] = ld.seconds
    res["load_peak_bytes"] = ld.peak_bytes
    return res
