"""Save and load plans of a small Llama + AdamW under LAYOUT (fsdp2; fsdp2-tp: a (k/2, 2) mesh,
TP size 2; zero1: zero.ZeroOptimizer stage 1): ``real LAYOUT OUT`` (under mpiexec -n k: a real
job, its real ckpt.save and the plans its ranks make) or ``sim LAYOUT K OUT`` (one process: the
plans ``bench ckpt --simulate-ranks`` makes for every rank of K). Writes JSON to OUT."""
from __future__ import annotations

import json
import os
import sys

MODEL = "layers=2,hidden=24,heads=4,kv_heads=2,ffn=40,vocab=11"  # odd sizes: uneven shards at 2-4 ranks
BLOCK, CHUNK = 4096, 8192
TP = 2  # fsdp2-tp's TP size (torch's TP needs even sizes: the tiny model's are)


def _tensors(manifest_json: str) -> list:
    d = json.loads(manifest_json)
    return [d["tensors"], d["files"]["data.bin"]["nbytes"], d["params"]]


def _items(items) -> list:
    return [[it.offset, it.nbytes, it.buf, it.buf_offset] for it in items]


def _llama(layout: str, mesh) -> "torch.nn.Module":
    """The tiny Llama as a user builds it: random weights, nn.Linear / nn.Embedding modules, FSDP2
    (fsdp2-tp: torch's tensor parallel on the mesh's "tp" dim first), or plain for zero1."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from bench import ckpt_simulate as cs

    torch.manual_seed(0)
    model = torch.nn.Module()
    for name, shape in cs.llama_shapes(cs.parse_model(MODEL)):
        *path, leaf = name.split(".")
        mod = model
        for i, part in enumerate(path):
            if not hasattr(mod, part):
                last = i == len(path) - 1
                if last and (part in cs.TP_DIM0 or part in cs.TP_DIM1) and part != "embed_tokens":
                    mod.add_module(part, torch.nn.Linear(shape[1], shape[0], bias=False))
                elif last and part == "embed_tokens":
                    mod.add_module(part, torch.nn.Embedding(*shape))
                else:
                    mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        if not hasattr(mod, leaf):
            mod.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape)))
    if layout == "fsdp2-tp":
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                       parallelize_module)

        plan = {}
        for name, _p in model.named_parameters():
            module = name.rsplit(".", 1)[0]
            leaf = module.rsplit(".", 1)[-1]
            plan[module] = (ColwiseParallel() if leaf in cs.TP_DIM0 and leaf != "embed_tokens" else
                            RowwiseParallel() if leaf in cs.TP_DIM1 or leaf == "embed_tokens" else SequenceParallel())
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "fsdp2":
        fully_shard(model, mesh=mesh)
    return model


def real(layout: str, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ckpt
    import mpicomm
    from ckpt import api
    from ckpt.optimizers import planner_for

    if layout == "zero1":
        from zero import ZeroOptimizer

        comm = mpicomm.as_communicator(None)
        k = comm.size
        model = _llama(layout, None)
        opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), stage=1, comm=comm, lr=1e-3)
    else:
        dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=120))
        comm = mpicomm.as_communicator(None)
        k = comm.size
        mesh = (init_device_mesh("cpu", (k // TP, TP), mesh_dim_names=("dp", "tp")) if layout == "fsdp2-tp"
                else init_device_mesh("cpu", (k,)))
        model = _llama(layout, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    path = os.path.join(os.path.dirname(out), f"ck{k}")
    ckpt.save(path, model=model, optimizer=opt, step=1, comm=comm, block_size=BLOCK, chunk_bytes=CHUNK)
    planner = planner_for(opt)
    sp, manifest, captured, summary = api._plan_save(comm, model, planner, planner.prepare_save(k), 1, None, {},
                                                     BLOCK, CHUNK)
    mine = api._plan_writes(comm, manifest, sp, captured, comm.mpi_comm.allgather(summary))
    with open(os.path.join(path, "manifest.json")) as f:
        text = f.read()
    pg = None if layout == "zero1" else dist.get_rank()
    rp, _match, _has = api._plan_load(comm, ckpt.Manifest.from_json(text), path, model, planner, True, {}, {},
                                      comm.mpi_comm.allgather(pg))
    saves = comm.mpi_comm.gather(_items(mine), root=0)
    loads = comm.mpi_comm.gather(_items(rp.items), root=0)
    if comm.rank == 0:
        with open(out, "w") as f:
            json.dump({"manifest": _tensors(text), "planned": _tensors(manifest.to_json()), "save": saves,
                       "load": loads}, f)
    if layout != "zero1":
        dist.destroy_process_group()


def sim(layout: str, k: int, out: str) -> None:
    from bench import ckpt_simulate as cs

    shapes = cs.llama_shapes(cs.parse_model(MODEL))
    saves, loads, text = [], [], None
    for r in range(k):
        res = cs.ckpt_save_rank(r, k, shapes, layout, TP, BLOCK, CHUNK)
        saves.append(_items(res["items"]))
        text = text or cs.ckpt_root_commit(res["manifest"]).value
    for r in range(k):
        loads.append(_items(cs.ckpt_load_rank(r, k, text, shapes, layout, TP, BLOCK, CHUNK)["items"]))
    with open(out, "w") as f:
        json.dump({"manifest": _tensors(text), "save": saves, "load": loads}, f)


if __name__ == "__main__":
    if sys.argv[1] == "real":
        real(sys.argv[2], sys.argv[3])
    else:
        sim(sys.argv[2], int(sys.argv[3]), sys.argv[4])
