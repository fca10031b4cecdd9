"""Error feedback across world sizes: what a rank takes of 1-bit state saved by other ranks.

Pure functions (no communication), used by ``load_per_rank_state_dict``. At the saved world
size every rank takes its own saved state unchanged (a resume is bit-identical). At another
size the error mass is carried forward:

- worker errors: the compressed mean owes the mean over saved ranks of their worker errors;
  every new rank takes that mean (computed in float64) on the first ``numel`` elements, zeros on
  its padding, so the mean over the new ranks owes the same;
- server errors: saved rank i's server error is the error of output positions of chunk i; the
  chunks, concatenated in rank order and cut to ``numel``, are re-chunked by the new layout
  (zero padding), so every output position keeps its own error.
"""
from __future__ import annotations

from typing import Any

import torch

from .wire_format import padded_size

__all__ = ["worker_error", "server_error", "allreduce_state"]


def _check_numel(saved: list[torch.Tensor], numel: int, per: str) -> int:
    p = len(saved)
    if p < 1:
        raise ValueError("reshard: expected the state of at least one saved rank, got none")
    want = padded_size(numel, p) // (p if per == "server" else 1)
    for i, t in enumerate(saved):
        if t.numel() != want:
            raise ValueError(f"reshard: saved rank {i}'s {per} error has {t.numel()} elements; "
                             f"expected {want} for {numel} elements saved at {p} ranks")
    return p


def worker_error(saved: list[torch.Tensor], numel: int, size: int) -> torch.Tensor:
    """The worker error (float32, padded_size(numel, size)) each rank of ``size`` ranks takes."""
    p = _check_numel(saved, numel, "worker")
    acc = torch.zeros(numel, dtype=torch.float64)
    for t in saved:
        acc += t.detach().reshape(-1)[:numel].to("cpu", torch.float64)
    out = torch.zeros(padded_size(numel, size), dtype=torch.float32)
    out[:numel] = (acc / p).to(torch.float32)
    return out


def server_error(saved: list[torch.Tensor], numel: int, rank: int, size: int) -> torch.Tensor:
    """The server error (float32, padded_size(numel, size) // size) rank ``rank`` of ``size`` takes."""
    _check_numel(saved, numel, "server")
    whole = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in saved])[:numel]
    padded = torch.zeros(padded_size(numel, size), dtype=torch.float32)
    padded[:numel] = whole
    chunk = padded.numel() // size
    return padded[rank * chunk:(rank + 1) * chunk].clone()


def allreduce_state(saved: list[dict[str, Any]], rank: int, size: int) -> dict[str, Any]:
    """``OnebitAllreduce.per_rank_state_dict()`` for rank ``rank`` of ``size`` from every saved
    rank's (in rank order): the saved rank's own at the same size, else the rule above."""
    p = len(saved)
    for i, st in enumerate(saved):
        if int(st.get("world_size", -1)) != p:
            raise ValueError(f"reshard: saved rank {i}'s state says world size {st.get('world_size')}, "
                             f"but {p} ranks' states were given")
    keys = list(saved[0]["errors"]) if p else []
    for i, st in enumerate(saved):
        if sorted(st["errors"]) != sorted(keys):
            raise ValueError(f"reshard: saved ranks 0 and {i} hold error buffers for different keys: "
                             f"{sorted(keys)} vs {sorted(st['errors'])}")
    if size == p:
        return saved[rank]
    errors = {}
    for key in keys:
        numels = {int(st["errors"][key]["numel"]) for st in saved}
        if len(numels) != 1:
            raise ValueError(f"reshard: key {key!r} has different sizes on the saved ranks: {sorted(numels)}")
        n = numels.pop()
        errors[key] = {"numel": n,
                       "worker_error": worker_error([st["errors"][key]["worker_error"] for st in saved], n, size),
                       "server_error": server_error([st["errors"][key]["server_error"] for st in saved], n,
                                                    rank, size)}
    return {"world_size": size, "errors": errors}
