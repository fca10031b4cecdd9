"""Sharded (ZeRO-style) training state saved and loaded with MPI collective I/O at any world size.

    opt = zero.ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=1, comm=comm, lr=1e-3)
    ...train...
    ckpt.save("run/step100", model=model, optimizer=opt, step=100, comm=comm)   # collective
    info = ckpt.load("run", model=model, optimizer=opt, comm=comm)              # follows run/latest
    ckpt.save(..., state={"sched": scheduler, "rng": ckpt.RNG(), "sampler": ckpt.PerRank(sampler)})

A checkpoint is a directory: ``manifest.json`` (format, world size, stage, tensors with byte
offsets, optimizer class and param_groups, per-block CRC-32, step, extras, state items) and
``data.bin`` (every tensor unpadded at its offset). A save writes into a hidden working directory marked
``INCOMPLETE`` and publishes it under its final name by an atomic rename (one committer at a
time per parent directory); unfinished saves are refused by name. ``python -m ckpt inspect|verify
PATH`` reads a checkpoint without MPI; ``convert`` and ``export`` move to and from DeepSpeed.
Every problem with a checkpoint raises a ``CheckpointError`` (its ``exit_code`` is the CLI's).

torch DCP: ``dcp.load(state, storage_reader=ckpt.DCPReader(path))`` reads a checkpoint into any
state dict DCP users build (FSDP2 included); ``python -m ckpt convert --from dcp DIR OUT`` (or
``ckpt.from_dcp(DIR, OUT)``) turns a DCP checkpoint into ours.

DeepSpeed: ``ckpt.from_deepspeed(tag_dir, path)`` imports a ZeRO checkpoint;
``ckpt.to_deepspeed_universal(path, out_dir)`` writes DeepSpeed's universal layout.

What lives where:
    api            save / load: the collective steps, top to bottom
    collective     runs a step on rank 0 or every rank; a failure raises on every rank
    io_plan        what each rank writes and reads: packed entries, local buffers, byte ranges
    model_state    ... of the model: its state in order, its weights, how it matches a checkpoint
    optimizers/    ... of an optimizer: one planner per kind (plain torch, ZeroOptimizer), all that
                   ckpt knows about optimizers
    items          ... of state items (``state=``) and optimizer extras: replicated or per rank
    dtensor        DTensors through metadata only (local shard, placements, mesh): layout, checks across ranks
    dtensor_layout pure: the global index ranges a mesh coordinate holds, and their runs of bytes
    stateful       RNG, PerRank, the per-rank protocol and its default rule (same_rank)
    tree           nested state as JSON plus raw tensors
    storage        working directory, commit, ``latest``, resolving paths, manifest and checksum checks
    commit         atomic publish (rename / exchange) under a directory lock
    errors         CheckpointError and its subclasses, the CLI's exit codes
    io             collective MPI-IO of planned byte ranges, with checksums
    byte_ranges    pure byte-range math;  manifest: the records and their JSON;  checksum: CRC-32
    manifest_checks  what a valid manifest is: its field and section checks, ManifestError and kin
    safetensors_header  the safetensors header that makes data.bin a safetensors file
    dtypes         the dtype names of the format;  progress_bar: the CLI's progress bars
    dcp_reader     DCPReader: torch DCP's StorageReader over our format (byte runs, checked blocks)
    dcp_convert    from_dcp: a DCP checkpoint (allowlisted .metadata, torch.save items) into ours
    cli            ``python -m ckpt``;  export: model-only safetensors;  deepspeed/: DeepSpeed import/export
    async_save     ``save(async_save=True)``: snapshot (now, or of parameters and optimizer state in the
                   background before the next step), then write and commit in the background
"""
from __future__ import annotations

from .api import LoadResult, load, save
from .async_save import AsyncSaveError, SaveHandle, wait_pending
from .export import export_safetensors
from .errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError, ChecksumError, FailureReport,
                     IncompatibleStateError, StateMismatchError, StepFailedError)
from .manifest import (FORMAT_VERSION, DamagedCheckpointError, IncompleteCheckpointError, Manifest, ManifestError,
                       TensorEntry)
from .stateful import RNG, PerRank, same_rank
from .storage import incomplete_reason, read_manifest, resolve
from .deepspeed import PickleRefusedError, from_deepspeed, to_deepspeed_universal


__all__ = [
    "AsyncSaveError", "DCPReader", "from_dcp", "SaveHandle", "export_safetensors", "wait_pending",
    "CheckpointError", "CheckpointExistsError", "CheckpointNotFoundError", "ChecksumError", "FailureReport",
    "DamagedCheckpointError", "FORMAT_VERSION", "IncompatibleStateError", "IncompleteCheckpointError", "LoadResult",
    "Manifest", "ManifestError", "PerRank", "PickleRefusedError", "RNG",
    "StateMismatchError", "StepFailedError", "TensorEntry", "from_deepspeed", "incomplete_reason", "load",
    "read_manifest", "resolve", "same_rank", "save", "to_deepspeed_universal",
]


def __getattr__(name: str):
    """DCP interop, imported on first use."""
    # torch.distributed.checkpoint is imported when DCP interop is first used, not with ckpt
    if name == "DCPReader":
        from .dcp_reader import DCPReader
        return DCPReader
    if name == "from_dcp":
        from .dcp_convert import from_dcp
        return from_dcp
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
