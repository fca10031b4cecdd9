"""Checking mode: before a collective, ranks agree cheaply on its arguments or all raise."""
from __future__ import annotations

import zlib

import numpy as np
from mpi4py import MPI

from .errors import CollectiveMismatchError


def agree(mpi_comm: MPI.Comm, call: str, signature: str) -> None:
    """Raise CollectiveMismatchError on every rank unless all ranks pass the same ``signature``."""
    text = f"{call}({signature})"
    h = ((zlib.crc32(text.encode()) << 31) ^ zlib.adler32(text.encode())) & ((1 << 62) - 1)
    pair = np.array([h, -h], dtype=np.int64)
    mpi_comm.Allreduce(MPI.IN_PLACE, pair, op=MPI.MAX)
    if pair[0] == h and pair[1] == -h:
        return
    texts = mpi_comm.allgather(text)
    lines = "\n".join(f"  rank {r}: {t}" for r, t in enumerate(texts))
    raise CollectiveMismatchError(
        f"{call}: the ranks of a communicator of size {mpi_comm.Get_size()} called it with "
        f"arguments that do not agree (this would hang or give garbage):\n{lines}")


def signature(t) -> str:
    """A tensor's dtype and shape as the ranks compare them: ``float32[4, 2]``."""
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
