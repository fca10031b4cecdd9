"""DeepSpeed side by side with ``bench ckpt``: the same model through ``save_checkpoint``,
``ds_to_universal`` and a universal ``load_checkpoint``, each in worker processes started here
(gloo, CPU), so that DeepSpeed's own launcher and MPI stay out of the measured job.

``python -m bench.ckpt_deepspeed save|load PATH LAYERS HIDDEN STAGE`` is one worker rank.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

from .models import mlp

__all__ = ["available", "measure", "worker"]

_TAG = "t"


def available() -> bool:
    """Whether DeepSpeed is importable here."""
    return importlib.util.find_spec("deepspeed") is not None


def worker(argv: list[str]) -> int:
    """One DeepSpeed rank (started by ``_run``, not by mpiexec): save or load, print the time."""
    mode, path, layers, hidden, stage = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    import torch
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    model = mlp(hidden, layers, seed=0)
    cfg = {"train_batch_size": dist.get_world_size(), "zero_optimization": {"stage": stage}}
    if mode == "load":
        cfg["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg,
                                           optimizer=torch.optim.Adam(model.parameters(), lr=1e-4))
    if mode == "save":
        from deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO

        engine.backward(engine(torch.randn(1, hidden)).sum())
        engine.step()
        dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(path, tag=_TAG, client_state={UNIVERSAL_CHECKPOINT_INFO: {}, "iteration": 1})
        dist.barrier()
    else:
        dist.barrier()
        t0 = time.perf_counter()
        engine.load_checkpoint(path, tag=_TAG + "_universal")
        dist.barrier()
    if dist.get_rank() == 0:
        print(f"DSTIME {time.perf_counter() - t0:.6f}", flush=True)
    return 0


def _run(mode: str, ranks: int, path: str, args, log: str) -> float:
    """Start ``ranks`` DeepSpeed workers on this host; return rank 0's timed seconds."""
    from .env import clean_env, free_port  # not at the top: a worker must not start MPI

    env = clean_env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(ranks),
               LOCAL_WORLD_SIZE=str(ranks))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    procs = []
    for r in range(ranks):
        env_r = dict(env, RANK=str(r), LOCAL_RANK=str(r))
        cmd = [sys.executable, "-m", "bench.ckpt_deepspeed", mode, path, str(args.layers),
               str(args.hidden), str(args.stage)]
        out = open(f"{log}.{mode}.{r}", "w")
        procs.append((subprocess.Popen(cmd, env=env_r, stdout=out, stderr=subprocess.STDOUT), out))
    seconds = None
    for r, (proc, out) in enumerate(procs):
        rc = proc.wait(timeout=1800)
        out.close()
        if rc != 0:
            raise RuntimeError(f"DeepSpeed {mode} rank {r} exited with {rc}; see {log}.{mode}.{r}")
    with open(f"{log}.{mode}.0") as f:
        for line in f:
            if line.startswith("DSTIME "):
                seconds = float(line.split()[1])
    if seconds is None:
        raise RuntimeError(f"DeepSpeed {mode}: no timing line in {log}.{mode}.0")
    return seconds


def _convert(path: str, log: str) -> float:
    from .env import clean_env

    src = os.path.join(path, _TAG)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", src,
           "--output_folder", src + "_universal"]
    t0 = time.perf_counter()
    with open(f"{log}.convert", "w") as out:
        rc = subprocess.run(cmd, env=clean_env(), stdout=out, stderr=subprocess.STDOUT, timeout=1800).returncode
    if rc != 0:
        raise RuntimeError(f"ds_to_universal exited with {rc}; see {log}.convert")
    return time.perf_counter() - t0


def measure(args, base: str) -> tuple[float, float, float]:
    """Seconds of DeepSpeed's save at ``--save-ranks``, conversion, and load at ``--load-ranks``
    (on one rank: it starts the workers); logs beside ``--json`` or in ``base``."""
    dpath = os.path.join(base, "ds")
    log = os.path.splitext(args.json)[0] + "-deepspeed" if args.json else os.path.join(base, "ds-log")
    return (_run("save", args.save_ranks, dpath, args, log), _convert(dpath, log),
            _run("load", args.load_ranks, dpath, args, log))


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
