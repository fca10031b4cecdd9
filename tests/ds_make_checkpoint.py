"""Make, or load and train on, a real DeepSpeed checkpoint of a tiny model on the CPU.

Run under MPI (DeepSpeed finds its ranks through mpi4py, gloo carries the collectives):

  mpiexec -n 2 python -m mpi4py tests/ds_make_checkpoint.py save --root DIR --tag t --stage 1 --dtype fp32
  mpiexec -n 3 python -m mpi4py tests/ds_make_checkpoint.py load --root DIR --stage 1 --dtype fp32

``save`` trains a few steps, saves tag ``--tag`` under ``--root`` and writes, from rank 0,
``<root>/<tag>.truth.pt``: DeepSpeed's own view of every parameter's full fp32 master,
exp_avg and exp_avg_sq (through ``deepspeed.utils.safe_get_full_*``), the optimizer step and
the model's dtype; with ``--universal`` rank 0 also converts the tag with DeepSpeed's
``ds_to_universal`` into ``<root>/<tag>_universal``. ``load`` starts a fresh engine with
``"load_universal": true`` at this world size, loads ``<root>/latest_universal``, writes
``<root>/loaded.<n>.pt`` with the same per-parameter view, the gathered weights and the losses
of a few more training steps, and exits non-zero on error.
Used by tests/test_ckpt_ds_*.py; needs deepspeed.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HIDDEN = (10, 13, 7, 3)


class TinyNet(torch.nn.Module):
    """Three linear layers with sizes that leave ZeRO padding at 2, 3 and 4 ranks, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(a, b) for a, b in zip(HIDDEN[:-1], HIDDEN[1:]))
        self.register_buffer("scale", torch.tensor([0.5, 1.0, 2.0]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.tanh(x)
        return torch.nn.functional.mse_loss(x * self.scale.to(x.dtype), y)


def config(stage: int, dtype: str, universal: bool) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-7,
                                 "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def engine_for(args: argparse.Namespace, universal: bool):
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401 (the name below is shadowed by torch itself)

    ds_torch_comm = sys.modules["deepspeed.comm.torch"]
    # DeepSpeed would JIT-compile a C++ shared-memory allreduce for the CPU (a minute, and a
    # compiler); gloo alone is enough here.
    ds_torch_comm.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=True,
                               distributed_port=int(os.environ.get("DS_TEST_PORT", "29500")),
                               verbose=False)
    torch.manual_seed(1234)
    model = TinyNet()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config(args.stage, args.dtype, universal))
    return engine


def batches(rank: int, steps: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    for _ in range(steps):
        x = torch.randn(4, HIDDEN[0], generator=g)
        y = torch.randn(4, HIDDEN[-1], generator=g)
        yield x.to(dtype), y.to(dtype)


def train(engine, steps: int, seed: int) -> list[float]:
    import deepspeed.comm as dist

    dtype = next(engine.module.parameters()).dtype
    losses = []
    for x, y in batches(dist.get_rank(), steps, seed, dtype):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


def full_view(engine) -> dict:
    """Every parameter's full fp32 master and Adam moments as DeepSpeed reports them (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = {"fp32": safe_get_full_fp32_param(p).detach().clone().cpu(),
                     "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").detach().clone().cpu(),
                     "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").detach().clone().cpu()}
    return out


def optimizer_step(engine) -> int:
    """The base optimizer's step count (the same for every state entry)."""
    opt = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    steps = {int(s["step"]) for s in opt.state.values() if "step" in s}
    return steps.pop() if len(steps) == 1 else -1


def cmd_save(args: argparse.Namespace) -> None:
    import deepspeed.comm as dist
    from deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO

    engine = engine_for(args, universal=False)
    losses = train(engine, args.steps, args.seed)
    engine.save_checkpoint(args.root, tag=args.tag,
                           client_state={UNIVERSAL_CHECKPOINT_INFO: {}, "iteration": args.steps})
    view = full_view(engine)
    dist.barrier()
    if args.universal and dist.get_rank() == 0:
        from types import SimpleNamespace

        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        tag_dir = os.path.join(args.root, args.tag)
        ds_to_universal(SimpleNamespace(input_folder=tag_dir, output_folder=f"{tag_dir}_universal",
                                        num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                        strict=True, inject_missing_state=False))
    if dist.get_rank() == 0:
        dtype = next(engine.module.parameters()).dtype
        torch.save({"params": view, "step": optimizer_step(engine), "dtype": str(dtype),
                    "losses": losses, "world_size": dist.get_world_size(),
                    "buffers": {n: b.detach().clone() for n, b in engine.module.named_buffers()}},
                   os.path.join(args.root, f"{args.tag}.truth.pt"))
    dist.barrier()
    engine.destroy()


def cmd_load(args: argparse.Namespace) -> None:
    import deepspeed
    import deepspeed.comm as dist

    engine = engine_for(args, universal=True)
    engine.load_checkpoint(args.root, tag=None, load_optimizer_states=True)
    view = full_view(engine)
    step = optimizer_step(engine)
    weights = {}
    for name, p in engine.module.named_parameters():
        if hasattr(p, "ds_id"):  # ZeRO-3: gather the partitioned weight (collective)
            with deepspeed.zero.GatheredParameters([p]):
                weights[name] = p.detach().clone()
        else:
            weights[name] = p.detach().clone()
    losses = train(engine, args.steps, args.seed)
    if dist.get_rank() == 0:
        torch.save({"params": view, "step": step, "weights": weights, "losses": losses,
                    "world_size": dist.get_world_size()},
                   os.path.join(args.root, f"loaded.{dist.get_world_size()}.pt"))
    dist.barrier()
    engine.destroy()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("save", "load"))
    ap.add_argument("--root", required=True)
    ap.add_argument("--tag", default="step")
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--universal", action="store_true",
                    help="save: also convert with DeepSpeed's ds_to_universal into <tag>_universal")
    args = ap.parse_args(argv)
    (cmd_save if args.mode == "save" else cmd_load)(args)


if __name__ == "__main__":
    main(sys.argv[1:])
