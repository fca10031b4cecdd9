"""Error feedback across world sizes and node layouts: what a rank takes of 1-bit state saved by
other ranks.

Pure functions (no communication), used by ``load_per_rank_state_dict``. When the world size
and the layout are the ones saved (flat, or hierarchical with every rank at the same node and
local index), every rank takes its own saved state unchanged (a resume is bit-identical).
Otherwise the error mass is carried forward through what the saved ranks owe together, per
position of the (unpadded) buffer:

- worker errors: the compressed mean owes the mean over saved ranks of their worker errors
  (hierarchical: for each part, the mean over its ranks of their worker errors, which they keep
  at the start of their buffers); every new rank takes what it owes for the positions
  its calls use (flat: all of them; hierarchical: its part), in float64, zeros on padding, so the
  mean over the new ranks owes the same;
- server errors: each saved rank's server error is the error of the output positions of its
  chunk (flat: chunk i of the buffer; hierarchical: chunk ``c`` of part ``j``); put back
  at their positions, cut to ``numel`` and re-chunked by the new layout (zero padding), every
  output position keeps its own error.

A layout is None (flat) or ``(nodes, per_node, positions)`` with ``positions[r] = (c, j)``: rank
r serves part ``j`` (its local index) and, within it, server chunk ``c`` (its rank among the
ranks of local index ``j``); a saved state records its rank's as ``"hierarchy": [nodes,
per_node, c, j]``.
"""
from __future__ import annotations

from typing import Any

import torch

from .wire_format import padded_size

__all__ = ["worker_error", "server_error", "allreduce_state", "saved_layout", "record"]

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


def _owed(saved: list[dict], layout, numel: int, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(worker error owed, float64; server error) per position of the first ``numel`` elements,
    from every saved rank's buffers for ``key`` under ``layout``."""
    we = [st["errors"][key]["worker_error"].detach().reshape(-1).to("cpu", torch.float64) for st in saved]
    se = [st["errors"][key]["server_error"].detach().reshape(-1).to("cpu", torch.float32) for st in saved]
    p = len(saved)
    padded = padded_size(numel, p)
    if layout is None:
        return sum(w[:numel] for w in we) / p, torch.cat(se)[:numel]
    nodes, per_node, positions = layout
    sub = padded // per_node
    chunk = sub // nodes
    owed = torch.zeros(padded, dtype=torch.float64)
    server = torch.zeros(padded, dtype=torch.float32)
    for (c, j), w, s in zip(positions, we, se):
        owed[j * sub:(j + 1) * sub] += w[:sub]
        server[j * sub + c * chunk:j * sub + (c + 1) * chunk] = s
    return owed[:numel] / nodes, server[:numel]


def _take(owed: torch.Tensor, server: torch.Tensor, numel: int, rank: int, size: int,
          layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(worker error, server error) of rank ``rank`` of ``size`` under ``layout`` (float32)."""
    padded = padded_size(numel, size)
    w = torch.zeros(padded, dtype=torch.float32)
    s = torch.zeros(padded, dtype=torch.float32)
    w[:numel] = owed.to(torch.float32)
    s[:numel] = server
    if layout is None:
        chunk = padded // size
        return w, s[rank * chunk:(rank + 1) * chunk].clone()
    nodes, per_node, positions = layout
    c, j = positions[rank]
    sub = padded // per_node
    chunk = sub // nodes
    mine = torch.zeros(padded, dtype=torch.float32)
    mine[:sub] = w[j * sub:(j + 1) * sub]
    return mine, s[j * sub + c * chunk:j * sub + (c + 1) * chunk].clone()


def worker_error(saved: list[torch.Tensor], numel: int, size: int) -> torch.Tensor:
    """The worker error (float32, padded_size(numel, size)) each rank of ``size`` flat ranks takes
    from flat saved ranks' worker errors."""
    p = _check_numel(saved, numel, "worker")
    owed = sum(t.detach().reshape(-1)[:numel].to("cpu", torch.float64) for t in saved) / p
    return _take(owed, torch.zeros(numel), numel, 0, size, None)[0]


def server_error(saved: list[torch.Tensor], numel: int, rank: int, size: int) -> torch.Tensor:
    """The server error (float32, padded_size(numel, size) // size) rank ``rank`` of ``size`` flat
    ranks takes from flat saved ranks' server errors."""
    _check_numel(saved, numel, "server")
    whole = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in saved])[:numel]
    return _take(torch.zeros(numel, dtype=torch.float64), whole, numel, rank, size, None)[1]


def saved_layout(saved: list[dict[str, Any]]):
    """The layout the saved ranks ran under (see the module doc), checked."""
    marks = [st.get("hierarchy") for st in saved]
    if all(m is None for m in marks):
        return None
    if any(m is None for m in marks):
        raise ValueError("reshard: some saved ranks ran the hierarchical algorithm and others the flat one")
    marks = [tuple(int(x) for x in m) for m in marks]
    nodes, per_node = marks[0][:2]
    positions = [m[2:] for m in marks]
    every = sorted((i, j) for i in range(nodes) for j in range(per_node))
    if any(len(m) != 4 or m[:2] != (nodes, per_node) for m in marks) or nodes * per_node != len(saved) \
            or sorted(positions) != every:
        raise ValueError(f"reshard: the saved ranks' hierarchy records {marks} do not describe {len(saved)} "
                         "ranks on nodes of equal size")
    return nodes, per_node, positions


def record(layout, rank: int) -> list[int] | None:
    """Rank ``rank``'s ``"hierarchy"`` entry under ``layout``: [nodes, per_node, c, j], or None (flat)."""
    if layout is None:
        return None
    return [int(layout[0]), int(layout[1]), *(int(x) for x in layout[2][rank])]


def allreduce_state(saved: list[dict[str, Any]], rank: int, size: int, layout=None) -> dict[str, Any]:
    """``OnebitAllreduce.per_rank_state_dict()`` for rank ``rank`` of ``size`` ranks running under
    ``layout`` (None: flat) from every saved rank's (in rank order): the saved rank's own at the
    same size and layout, else the rule above."""
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
    before = saved_layout(saved)
    if layout is not None:
        layout = (int(layout[0]), int(layout[1]), [tuple(int(x) for x in pos) for pos in layout[2]])
    if size == p and before == layout:
        return saved[rank]
    errors = {}
    for key in keys:
        numels = {int(st["errors"][key]["numel"]) for st in saved}
        if len(numels) != 1:
            raise ValueError(f"reshard: key {key!r} has different sizes on the saved ranks: {sorted(numels)}")
        n = numels.pop()
        _check_numel([st["errors"][key]["worker_error"] for st in saved], n, "worker")
        _check_numel([st["errors"][key]["server_error"] for st in saved], n, "server")
        we, se = _take(*_owed(saved, before, n, key), n, rank, size, layout)
        errors[key] = {"numel": n, "worker_error": we, "server_error": se}
    out: dict[str, Any] = {"world_size": size, "errors": errors}
    if layout is not None:
        out["hierarchy"] = record(layout, rank)
    return out
