"""Sharded (ZeRO-style) training state saved and loaded with MPI collective I/O at any world size.

    opt = ckpt.ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=1, comm=comm, lr=1e-3)
    ...train...
    ckpt.save("run/step100", model=model, optimizer=opt, step=100, comm=comm)   # collective
    info = ckpt.load("run", model=model, optimizer=opt, comm=comm)              # follows run/latest

A checkpoint is a directory: ``manifest.json`` (format, world size, stage, tensors with byte
offsets, optimizer class and param_groups, per-block CRC-32, step, extras) and ``data.bin``
(every tensor unpadded at its offset). A save writes into a hidden working directory marked
``INCOMPLETE`` and publishes it under its final name by an atomic rename (one committer at a
time per parent directory); unfinished saves are refused by name. ``python -m ckpt inspect|verify
PATH`` reads a checkpoint without MPI; ``convert`` and ``export`` move to and from DeepSpeed.

DeepSpeed: ``ckpt.from_deepspeed(tag_dir, path)`` imports a ZeRO checkpoint;
``ckpt.to_deepspeed_universal(path, out_dir)`` writes DeepSpeed's universal layout.
"""
from __future__ import annotations

from .api import (ChecksumError, CollectiveError, LoadResult, StateMismatchError, incomplete_reason, load,
                  read_manifest, resolve, save)
from .layout import Segment, ShardLayout
from .manifest import (FORMAT_VERSION, DamagedCheckpointError, IncompleteCheckpointError, Manifest, ManifestError,
                       TensorEntry)
from .zero import ZeroOptimizer
from .deepspeed import PickleRefusedError, from_deepspeed, to_deepspeed_universal  # noqa: E402

__all__ = [
    "ChecksumError", "CollectiveError", "DamagedCheckpointError", "FORMAT_VERSION", "IncompleteCheckpointError",
    "LoadResult", "Manifest", "ManifestError", "PickleRefusedError", "Segment", "ShardLayout",
    "StateMismatchError", "TensorEntry", "ZeroOptimizer", "from_deepspeed", "incomplete_reason", "load",
    "read_manifest", "resolve", "save", "to_deepspeed_universal",
]
