"""ckpt's planning on one simulated rank, measured: ``ckpt.save``'s and ``ckpt.load``'s own planning
steps (``ckpt.api``) fed what the collectives between them would deliver at N ranks, the root's
commit work, and the wall time, Python heap peak or call count of a step."""
from __future__ import annotations

import gc
import json
import math
import pickle
import sys
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable

from bench.ckpt_sim_world import FakeComm, rank_state

@dataclass
class Measured:
    """A step's wall time, its Python heap peak in bytes (-1: not measured) and what it returned."""

    seconds: float
    peak_bytes: int
    value: Any


def count_calls(fn: Callable[[], Any]) -> int:
    """How many Python and C function calls ``fn()`` makes: its work, counted, not timed."""
    calls = 0

    def prof(_frame, event, _arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def measure(fn: Callable[[], Any], memory_below_s: float = math.inf) -> Measured:
    """``fn()``'s wall time (a plain run), then, when that took under ``memory_below_s``, its peak
    Python heap growth (tracemalloc, which slows Python down, in a second run; else -1); the
    first run's value."""
    gc.collect()
    t0 = time.perf_counter()
    value = fn()
    dt = time.perf_counter() - t0
    if dt >= memory_below_s:
        return Measured(dt, -1, value)
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return Measured(dt, peak, value)


def sample_ranks(n: int) -> list[int]:
    """The ranks of ``n`` that are simulated: first, middle, last."""
    return sorted({0, n // 2, n - 1})


def ckpt_save_rank(rank: int, n: int, shapes: list[tuple[str, tuple[int, ...]]], layout: str, group: int,
                   block_size: int, chunk_bytes: int, count: bool = False, memory: bool = True) -> dict[str, Any]:
    """Run ckpt.save's planning steps of ``rank`` of ``n``; return its figures and plans (with
    ``count``, also "calls": the function calls the planning makes; without ``memory``, no peak)."""
    from ckpt import api, io
    from ckpt.optimizers import planner_for

    with rank_state(layout, rank, n, group, shapes, True) as (model, opt):
        comm = FakeComm(rank, n)
        planner = planner_for(opt)

        def plan(summaries):
            prepared = planner.prepare_save(n)
            sp, manifest, captured, summary = api._plan_save(comm, model, planner, prepared, 1, None, {}, block_size,
                                                             chunk_bytes)
            if summaries is None:  # what the allgather of the summaries delivers: every rank's, in rank order
                summaries = [dict(summary, **{"@pg": None if summary["@pg"] is None else q}) for q in range(n)]
            mine = api._plan_writes(comm, manifest, sp, captured, summaries)
            rounds = io._plan(mine, set(range(len(sp.buffers))), chunk_bytes, block_size)
            return summary, summaries, manifest, mine, rounds

        summaries = plan(None)[1]
        got = measure(lambda: plan(summaries), math.inf if memory else 0)
        summary, _s, manifest, mine, rounds = got.value
        calls = count_calls(lambda: plan(summaries)) if count else None
        npieces = sum(len(range(c.offset // block_size, (c.offset + c.nbytes - 1) // block_size + 1))
                      for r in rounds for c in r)
        return {"rank": rank, "seconds": got.seconds, "peak_bytes": got.peak_bytes, "summary": summary, "manifest": manifest,
                "items": mine, "rounds": len(rounds), "pieces": npieces,
                "summary_bytes": len(pickle.dumps(summary)), "calls": calls}


def ckpt_root_commit(manifest: Any) -> Measured:
    """The root's commit work once the data is written: block CRCs from the reduced per-block
    parts, the manifest's checks and JSON (the reduction's values are synthesised: zeros)."""
    import numpy as np

    from ckpt import checksum
    from ckpt.manifest import DATA_NAME

    f = manifest.files[DATA_NAME]
    nblocks = checksum.num_blocks(int(f["nbytes"]), manifest.block_size)
    parts = np.zeros(nblocks, np.uint32)
    counts = np.array([min(manifest.block_size, int(f["nbytes"]) - b * manifest.block_size) for b in range(nblocks)],
                      np.int64)

    def commit():
        f["crc32"] = checksum.blocks_from_parts(parts, counts, int(f["nbytes"]), manifest.block_size)
        manifest.validate()
        return manifest.to_json()

    return measure(commit)


def ckpt_load_rank(rank: int, m: int, text: str, shapes: list[tuple[str, tuple[int, ...]]], layout: str,
                   group: int, block_size: int, chunk_bytes: int, memory: bool = True) -> dict[str, Any]:
    """Run ckpt.load's planning steps of ``rank`` of ``m`` on the manifest ``text``."""
    from ckpt import api, checksum, io
    from ckpt.manifest import Manifest
    from ckpt.optimizers import planner_for

    with rank_state(layout, rank, m, group, shapes, False) as (model, opt):
        planner = planner_for(opt)
        pgs = [None] * m if layout == "zero1" else list(range(m))  # no torch.distributed group under ZeRO

        def plan():
            # as ckpt.load: rank 0 reads the file and checks it all (its CRC, every field), the
            # others parse the bytes it broadcasts
            man = Manifest.from_json(text, checked=rank != 0)
            rp, _match, _has = api._plan_load(FakeComm(rank, m), man, "<simulated>", model, planner, True, {}, {}, pgs)
            itemsize = {i: 4 for i in range(len(rp.dests))}
            rounds = io._plan(rp.items, set(range(len(rp.dests))), chunk_bytes, block_size, itemsize)
            return rp, rounds

        got = measure(plan, math.inf if memory else 0)
        rp, rounds = got.value
        nblocks = checksum.num_blocks(int(json.loads(text)["files"]["data.bin"]["nbytes"]), block_size)
        return {"rank": rank, "seconds": got.seconds, "peak_bytes": got.peak_bytes, "ranges": len(rp.items),
                "checksum_reduce_bytes": nblocks * 12, "reported": len(rp.dests) - len(rp.unchecked),
                "dests": len(rp.dests),
                "rounds": len(rounds), "bytes": sum(it.nbytes for it in rp.items), "items": rp.items}

