"""Observability: every collective in torch.profiler traces (name and bytes), DEBUG logs per call,
an INFO line at init, MPICOMM_LOG_LEVEL; and nothing of it runs when neither is active."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
from mpi4py import MPI

from mpicomm import observe
from mpicomm import clean_env
from mpitest import assert_all, check_all

OPS = ["all_reduce", "reduce", "reduce_scatter_tensor", "broadcast", "all_gather_into_tensor",
       "all_gather", "all_to_all_single", "gather", "scatter", "barrier"]


def _run_all(comm):
    n = comm.size
    x = torch.ones(8)  # 32 bytes
    comm.all_reduce(x)
    comm.reduce(torch.ones(8), dst=0)
    comm.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * n))
    comm.broadcast(torch.ones(3, dtype=torch.float8_e4m3fn), src=0)
    comm.all_gather_into_tensor(torch.empty(2 * n), torch.ones(2))
    comm.all_gather([torch.empty(2) for _ in range(n)], torch.ones(2))
    comm.all_to_all_single(torch.empty(2 * n), torch.ones(2 * n))
    comm.gather(torch.ones(2), [torch.empty(2) for _ in range(n)] if comm.rank == 0 else None)
    comm.scatter(torch.empty(2), [torch.ones(2) for _ in range(n)] if comm.rank == 0 else None)
    comm.barrier()


@pytest.mark.mpi(min_size=1)
def test_every_collective_is_in_the_profiler_trace_with_bytes(comm, tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        _run_all(comm)
        if comm.size > 1:
            right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
            works = [comm.irecv(torch.empty(4), src=left), comm.isend(torch.ones(4), dst=right)]
            for w in works:
                w.wait()
    names = {e.name for e in prof.events()}
    path = tmp_path / f"trace{comm.rank}.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"]
              if e.get("name", "").startswith("mpicomm:")]
    by_name = {e["name"]: e["args"] for e in events}

    def check():
        missing = [op for op in OPS if f"mpicomm:{op}" not in names]
        assert not missing, f"no profiler event for {missing}; got {sorted(names)}"
        if comm.size > 1:
            assert {"mpicomm:isend", "mpicomm:irecv"} <= names
        assert by_name["mpicomm:all_reduce"]["bytes"] == 32, by_name["mpicomm:all_reduce"]
        assert by_name["mpicomm:all_reduce"]["dtype"] == "float32"
        assert by_name["mpicomm:broadcast"]["dtype"] == "float8_e4m3fn"
        assert by_name["mpicomm:all_gather_into_tensor"]["bytes"] == 4 * (2 * comm.size + 2)

    check_all(check)


@pytest.mark.mpi(min_size=1)
def test_debug_logs_each_collective(comm, caplog, monkeypatch):
    with caplog.at_level(logging.DEBUG, logger="mpicomm"):
        _run_all(comm)
    lines = [r.getMessage() for r in caplog.records if r.name == "mpicomm"]

    def check():
        for op in OPS:
            assert any(f"rank {comm.rank}: {op} " in m for m in lines), (op, lines)
        first = next(m for m in lines if ": all_reduce " in m)
        assert "float32 32 B in " in first and first.endswith(" us"), first

    check_all(check)


@pytest.mark.mpi(min_size=1)
def test_debug_switched_on_between_remembered_calls(comm, caplog):
    """DEBUG turned on after fast calls have cached "not enabled" (the logger's level cache,
    read through a bound ``get``): the next call of the same tensors is logged."""
    n = comm.size
    x, out, big = torch.ones(2), torch.empty(2 * n), torch.ones(2 * n)
    calls = {"all_reduce": lambda: comm.all_reduce(x),
             "broadcast": lambda: comm.broadcast(x, src=0),
             "all_gather_into_tensor": lambda: comm.all_gather_into_tensor(out, x),
             "reduce_scatter_tensor": lambda: comm.reduce_scatter_tensor(x, big)}
    logger = logging.getLogger("mpicomm")
    logger.setLevel(logging.INFO)
    try:
        for call in calls.values():
            call()
            call()  # remembered
        assert_all(observe._debug_cached(logging.DEBUG) is False, "the level cache was not filled")
        with caplog.at_level(logging.DEBUG, logger="mpicomm"):
            for call in calls.values():
                call()
    finally:
        logger.setLevel(logging.NOTSET)
    lines = [r.getMessage() for r in caplog.records if r.name == "mpicomm"]
    missing = [op for op in calls if not any(f"rank {comm.rank}: {op} " in m for m in lines)]
    assert_all(missing == [], f"not logged after DEBUG was switched on: {missing}")


@pytest.mark.mpi(min_size=1)
def test_nothing_is_traced_without_profiler_or_debug(comm, monkeypatch):
    traced = []
    monkeypatch.setattr(observe, "_traced", lambda *a: traced.append(a[1]))
    logging.getLogger("mpicomm").setLevel(logging.INFO)
    try:
        _run_all(comm)
    finally:
        logging.getLogger("mpicomm").setLevel(logging.NOTSET)
    assert_all(traced == [], f"traced without a profiler: {traced}")


@pytest.mark.mpi(min_size=1)
def test_init_line_names_library_ranks_device_and_verdict(comm, caplog):
    with caplog.at_level(logging.INFO, logger="mpicomm"):
        observe.log_init(comm)
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "mpicomm")

    def check():
        assert f"rank {comm.rank} of {comm.size}, local rank {comm.local_rank} of " in text, text
        assert "MPI: " + MPI.get_vendor()[0].split()[0] in text, text
        assert "device " in text and "CUDA-aware MPI: " in text and "large counts" in text, text

    check_all(check)


def test_log_level_from_the_environment():
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("starts its own process; run in the single-process pass")
    script = "import mpicomm, torch; c = mpicomm.init(); c.all_reduce(torch.ones(4))"
    env = clean_env()
    env["MPICOMM_LOG_LEVEL"] = "debug"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "mpicomm INFO: rank 0 of 1, local rank 0 of 1; MPI: " in proc.stderr, proc.stderr
    assert "mpicomm DEBUG: rank 0: all_reduce float32 16 B in " in proc.stderr, proc.stderr
    env["MPICOMM_LOG_LEVEL"] = "chatty"
    bad = subprocess.run([sys.executable, "-c", "import mpicomm"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "MPICOMM_LOG_LEVEL='chatty'" in bad.stderr, bad.stderr
