"""Sharded (ZeRO-style) training state saved and loaded with MPI collective I/O at any world size.

    opt = ckpt.ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=1, comm=comm, lr=1e-3)
    ...train...
    ckpt.save("run/step100", model=model, optimizer=opt, step=100, comm=comm)   # collective
    info = ckpt.load("run", model=model, optimizer=opt, comm=comm)              # follows run/latest

A checkpoint is a directory: ``manifest.json`` (format, world size, stage, tensors with byte
offsets, optimizer class and param_groups, per-block CRC-32, step, extras) and ``data.bin``
(every tensor unpadded at its offset). ``python -m ckpt inspect|verify PATH`` reads it without MPI.
"""
from __future__ import annotations

from .api import ChecksumError, LoadResult, load, read_manifest, resolve, save
from .layout import Segment, ShardLayout
from .manifest import FORMAT_VERSION, Manifest, ManifestError, TensorEntry
from .zero import ZeroOptimizer

__all__ = [
    "ChecksumError", "FORMAT_VERSION", "LoadResult", "Manifest", "ManifestError", "Segment",
    "ShardLayout", "TensorEntry", "ZeroOptimizer", "load", "read_manifest", "resolve", "save",
]
