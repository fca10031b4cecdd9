"""Save and load plans of a small Llama under FSDP2 + AdamW: ``real OUT`` (under mpiexec -n k: a
real job, its real ckpt.save and the plans its ranks make) or ``sim K OUT`` (one process: the
plans ``bench ckpt --simulate-ranks`` makes for every rank of K). Writes JSON to OUT."""
from __future__ import annotations

import json
import os
import sys

MODEL = "layers=2,hidden=24,heads=4,kv_heads=2,ffn=40,vocab=11"  # odd sizes: uneven shards at 2-4 ranks
BLOCK, CHUNK = 4096, 8192


def _tensors(manifest_json: str) -> list:
    d = json.loads(manifest_json)
    return [d["tensors"], d["files"]["data.bin"]["nbytes"], d["params"]]


def _items(items) -> list:
    return [[it.offset, it.nbytes, it.buf, it.buf_offset] for it in items]


def real(out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckpt
    import mpicomm
    from bench import ckpt_simulate as cs
    from ckpt import api
    from ckpt.optimizers import planner_for

    dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=120))
    comm = mpicomm.as_communicator(None)
    k = comm.size
    mesh = init_device_mesh("cpu", (k,))
    torch.manual_seed(0)
    model = torch.nn.Module()
    for name, shape in cs.llama_shapes(cs.parse_model(MODEL)):
        *path, leaf = name.split(".")
        mod = model
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape)))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
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
    rp, _match, _has = api._plan_load(comm, ckpt.Manifest.from_json(text), path, model, planner, True, {}, {},
                                      comm.mpi_comm.allgather(dist.get_rank()))
    saves = comm.mpi_comm.gather(_items(mine), root=0)
    loads = comm.mpi_comm.gather(_items(rp.items), root=0)
    if comm.rank == 0:
        with open(out, "w") as f:
            json.dump({"manifest": _tensors(text), "planned": _tensors(manifest.to_json()), "save": saves,
                       "load": loads}, f)
    dist.destroy_process_group()


def sim(k: int, out: str) -> None:
    from bench import ckpt_simulate as cs

    shapes = cs.llama_shapes(cs.parse_model(MODEL))
    saves, loads, text = [], [], None
    for r in range(k):
        res = cs.ckpt_save_rank(r, k, shapes, "fsdp2", 8, BLOCK, CHUNK)
        saves.append(_items(res["items"]))
        text = text or cs.ckpt_root_commit(res["manifest"]).value
    for r in range(k):
        loads.append(_items(cs.ckpt_load_rank(r, k, text, shapes, "fsdp2", 8, BLOCK, CHUNK)["items"]))
    with open(out, "w") as f:
        json.dump({"manifest": _tensors(text), "save": saves, "load": loads}, f)


if __name__ == "__main__":
    if sys.argv[1] == "real":
        real(sys.argv[2])
    else:
        sim(int(sys.argv[2]), sys.argv[3])
