"""Sharded (ZeRO-style) training state saved and loaded with MPI collective I/O at any world size."""
from __future__ import annotations

from .api import ChecksumError, LoadResult, load, read_manifest, resolve, save
from .layout import Segment, ShardLayout
from .manifest import FORMAT_VERSION, Manifest, ManifestError, TensorEntry
from .zero import ZeroOptimizer

__all__ = [
    "ChecksumError", "FORMAT_VERSION", "LoadResult", "Manifest", "ManifestError", "Segment",
    "ShardLayout", "TensorEntry", "ZeroOptimizer", "load", "read_manifest", "resolve", "save",
]
