"""Every rank's failure domain (its host, or ``TorchState(failure_domain=...)``) and the replica
stride they give: gathered once per communicator."""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from . import replicas


def _tag(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little", signed=True)


def stride(state: Any, comm: Any) -> int:
    """The replica stride over ``comm`` from every rank's failure domain (collective, once per
    communicator; remembered in ``state._strides`` with every rank's host id)."""
    known, value, _ = state._strides
    if known is comm:
        return value
    from mpi4py import MPI

    host = MPI.Get_processor_name()
    ids = torch.zeros(2 * int(comm.size), dtype=torch.int64)
    comm.all_gather_into_tensor(ids, torch.tensor([_tag(state.failure_domain or host), _tag(host)],
                                                  dtype=torch.int64))
    value = replicas.stride(ids[0::2].tolist())
    state._strides = (comm, value, ids[1::2].tolist())
    return value


def hosts(state: Any) -> list[int]:
    """Every rank's host id over the communicator ``stride`` was last gathered over."""
    return state._strides[2]
