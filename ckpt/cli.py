"""Command line: ``python -m ckpt inspect|verify|convert|export``.

inspect and verify need no MPI; convert and export run on every rank of an ``mpiexec`` job
(or alone), sharing the work.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import mpicomm
from mpicomm import format_bytes

from .collective import Collective
from .errors import (EXIT_DAMAGED, EXIT_EXISTS, EXIT_FAILED, EXIT_INCOMPLETE, EXIT_OK, EXIT_PICKLE, EXIT_USAGE,
                     CheckpointError, CheckpointExistsError, StateMismatchError, StepFailedError)
from .io import read_blocks
from .manifest import DATA_NAME, FORMAT_VERSION, ITEMSIZE, ManifestError, TensorEntry
from .progress_bar import Bar
from .storage import read_manifest, resolve

EXIT_CODES_HELP = f"""exit codes:
  {EXIT_OK}  success (verify: every block matches its checksum)
  {EXIT_DAMAGED}  the checkpoint is damaged: a checksum mismatch (the tensors and blocks are named),
     or a truncated or missing data file
  {EXIT_USAGE}  bad arguments, or no checkpoint at PATH (nothing there, a manifest that does not
     parse, or one from a newer format version than {FORMAT_VERSION})
  {EXIT_INCOMPLETE}  PATH is an incomplete checkpoint: a save that did not finish (never loaded)
  {EXIT_PICKLE}  convert: the source holds a pickled Python global that DeepSpeed checkpoints (or
     DCP's .metadata) never contain (refused, never unpickled, with or without --allow-pickle)
  {EXIT_EXISTS}  the destination exists (pass --overwrite to replace it)
  {EXIT_FAILED}  any other failure (I/O or MPI error, unsupported source format, a failure on
     another rank)
"""

PICKLE_HELP = ("unnecessary, accepted for compatibility: DeepSpeed's files are pickles, and they are "
               "always loaded weights-only, with DeepSpeed's own classes as inert stand-ins, so no code "
               "in them can run; a file holding any other Python global is refused with or without it.")


def _fmt_size(n: int) -> str:
    return format_bytes(n)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _inspect(args: argparse.Namespace) -> int:
    m = read_manifest(args.path)
    if args.json:
        print(m.to_json())
        return EXIT_OK
    f = m.files[DATA_NAME]
    print(f"checkpoint {resolve(args.path)}")
    print(f"  format version {m.version}, saved by {m.world_size} rank(s), "
          f"stage {m.stage if m.stage is not None else '-'}, step {m.step}")
    print(f"  {len(m.params)} model tensors, {sum(_numel(p.shape) for p in m.params):,} elements; "
          f"data {f['nbytes']:,} bytes in {len(f['crc32'])} block(s) of {m.block_size:,}")
    if m.optimizer:
        print(f"  optimizer {m.optimizer['class']}, state keys {m.state_keys()}, "
              f"{len(m.optimizer['param_groups'])} param group(s)")
        for i, g in enumerate(m.optimizer["param_groups"]):
            hp = {k: v for k, v in g.items() if k != "params"}
            print(f"    group {i}: {len(g['params'])} params, {hp}")
    sharded = [t for t in m.tensors if t.boxes is not None or t.layout is not None]
    if sharded:
        print(f"  {len(sharded)} tensor(s) saved from DTensor shards (stored whole; --tensors lists the shards)")
    if m.extra is not None:
        print(f"  extra {json.dumps(m.extra)}")
    section = m.state or {}
    for name, entry in sorted(section.get("items", {}).items()):
        print(f"  state item {name!r}: {_item_parts(entry)}")
    if "optimizer" in section:
        print(f"  optimizer extra state: {_item_parts(section['optimizer'])}")
    if args.tensors:
        print(f"  {'kind':<8} {'key':<12} {'dtype':<9} {'offset':>14} {'nbytes':>12}  name shape")
        for t in m.tensors:
            shards = f" from {_shards(t)} DTensor shard(s)" if t.boxes is not None or t.layout is not None else ""
            print(f"  {t.kind:<8} {t.key or '-':<12} {t.dtype:<9} {t.offset:>14} {t.nbytes:>12}  "
                  f"{t.name} {list(t.shape)}{shards}")
    else:
        rows = [(p.name + (" (buffer)" if p.buffer else ""), "x".join(map(str, p.shape)) or "scalar", p.dtype,
                 _fmt_size(_numel(p.shape) * ITEMSIZE[p.dtype])) for p in m.params]
        w = max([len("name")] + [len(r[0]) for r in rows])
        ws = max([len("shape")] + [len(r[1]) for r in rows])
        print(f"  {'name':<{w}}  {'shape':<{ws}}  {'dtype':<9} {'size':>10}")
        for r in rows:
            print(f"  {r[0]:<{w}}  {r[1]:<{ws}}  {r[2]:<9} {r[3]:>10}")
        print("  (--tensors lists every stored tensor, optimizer state included; --json the manifest)")
    return EXIT_OK


def _shards(t: TensorEntry) -> int:
    """How many distinct DTensor shards a tensor was saved from (its layout rule, or an old manifest's boxes)."""
    if t.layout is None:
        return len(t.boxes) if isinstance(t.boxes, list) else 0
    return math.prod(n for n, p in zip(t.layout["mesh"], t.layout["placements"]) if p[0] != "replicate")


def _item_parts(entry: dict) -> str:
    parts = []
    if "value" in entry:
        parts.append(f"replicated ({len(entry['tensors'])} tensor(s))")
    if "ranks" in entry:
        parts.append(f"per rank, saved by {len(entry['ranks'])} rank(s)")
    return ", ".join(parts)


def _verify(args: argparse.Namespace) -> int:
    m = read_manifest(args.path)
    f = m.files[DATA_NAME]
    size = int(f["nbytes"])
    nblocks = len(f["crc32"])
    fname = os.path.join(resolve(args.path), DATA_NAME)
    bar = Bar(_show_progress(args, 0))
    bad = []
    step = max(1, min(64, (256 << 20) // m.block_size))  # about 256 MiB between redraws
    for lo in range(0, nblocks, step):
        blocks = list(range(lo, min(nblocks, lo + step)))
        crcs = read_blocks(fname, blocks, m.block_size, size)
        bad += [b for b, c in zip(blocks, crcs) if c != f["crc32"][b]]
        bar("verifying", blocks[-1] + 1, nblocks)
    bar.close()
    if bad:
        print(f"BAD: {len(bad)} of {nblocks} blocks fail their checksum: {bad[:20]}")
        print(f"  {fname}: {m.describe_blocks(bad, limit=20)}")
        return EXIT_DAMAGED
    print(f"ok: {nblocks} blocks, {size:,} bytes")
    return EXIT_OK


def _show_progress(args: argparse.Namespace, rank: int) -> bool:
    if rank != 0 or args.progress is False:
        return False
    return bool(args.progress) or sys.stderr.isatty()


def _dest_ready(path: str, overwrite: bool) -> None:
    if os.path.lexists(path) and not overwrite and (not os.path.isdir(path) or os.listdir(path)):
        raise CheckpointExistsError(f"{path} exists (pass --overwrite to replace it)")


def _convert(args: argparse.Namespace) -> int:
    from .deepspeed import from_deepspeed

    comm = mpicomm.as_communicator(None)
    bar = Bar(_show_progress(args, comm.rank), prefix="convert: ")
    Collective(comm, "convert").on_root("checking the destination",
                                        lambda: _dest_ready(os.path.abspath(args.dst), args.overwrite))
    if args.source_format == "dcp":
        from .dcp_convert import from_dcp

        m = from_dcp(args.src, args.dst, comm=comm, optimizer=args.optimizer, overwrite=args.overwrite)
        bar.close()
        if comm.rank == 0:
            opt = f", optimizer {m.optimizer['class']}" if m.optimizer else ""
            print(f"ok: {args.src} -> {os.path.abspath(args.dst)} ({len(m.params)} tensors{opt}, step {m.step}; "
                  "loads at any world size)")
        return EXIT_OK
    if args.optimizer:
        raise ManifestError("--optimizer is for --from dcp (DeepSpeed checkpoints name their optimizer)")
    m = from_deepspeed(args.src, args.dst, comm=comm, allow_pickle=args.allow_pickle, overwrite=args.overwrite,
                       progress=bar)
    bar.close()
    if comm.rank == 0:
        print(f"ok: {args.src} -> {os.path.abspath(args.dst)} ({len(m.params)} tensors, step {m.step}, "
              f"sharded for stage {m.stage} over {m.world_size} rank(s); loads at any world size)")
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    from .deepspeed import to_deepspeed_universal

    if args.target_format == "safetensors":
        return _export_safetensors(args)
    comm = mpicomm.as_communicator(None)
    bar = Bar(_show_progress(args, comm.rank), prefix="export: ")
    Collective(comm, "export").on_root("checking the paths", lambda: (
        resolve(args.src), _dest_ready(os.path.abspath(args.dst), args.overwrite)))
    out = to_deepspeed_universal(args.src, args.dst, comm=comm, progress=bar)
    bar.close()
    if comm.rank == 0:
        print(f"ok: {resolve(args.src)} -> {out} (DeepSpeed universal checkpoint; load it with "
              '"checkpoint": {"load_universal": true})')
    return EXIT_OK


def _export_safetensors(args: argparse.Namespace) -> int:
    from .export import export_safetensors

    comm = mpicomm.as_communicator(None)
    dst = os.path.abspath(args.dst)
    Collective(comm, "export").on_root("writing the safetensors file", lambda: (
        _dest_ready(dst, args.overwrite), export_safetensors(args.src, dst)))
    if comm.rank == 0:
        print(f"ok: {resolve(args.src)} -> {dst} (safetensors, the model's state only)")
    return EXIT_OK


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ckpt", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Inspect, verify and convert mpicomm checkpoints. convert and export run in parallel "
                    "under mpiexec (e.g. mpiexec -n 4 python -m ckpt convert ...).",
        epilog=EXIT_CODES_HELP)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{inspect,verify,convert,export}")

    def progress_flags(sp: argparse.ArgumentParser) -> None:
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--progress", action="store_true", default=None,
                       help="draw a progress bar on stderr (default: only when stderr is a terminal)")
        g.add_argument("--no-progress", dest="progress", action="store_false", help="never draw one")

    i = sub.add_parser("inspect", help="tensors, shapes, dtypes, sizes, world size, stage, step",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("path", help="checkpoint directory, or a directory with a 'latest' pointer")
    i.add_argument("--tensors", action="store_true", help="list every stored tensor with its offset")
    i.add_argument("--json", action="store_true", help="print the manifest (JSON) itself")
    v = sub.add_parser("verify", help="read every block and check its CRC-32 (exit 1 on a mismatch)",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("path", help="checkpoint directory, or a directory with a 'latest' pointer")
    progress_flags(v)
    c = sub.add_parser("convert", help="import a DeepSpeed ZeRO checkpoint or a torch DCP checkpoint",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--from", dest="source_format", required=True, choices=["deepspeed", "dcp"],
                   help="format of SRC")
    c.add_argument("src", help="deepspeed: DeepSpeed tag folder, or the save folder whose 'latest' names one; "
                               "dcp: the folder torch.distributed.checkpoint.save wrote (.metadata, *.distcp)")
    c.add_argument("--optimizer", metavar="NAME", default=None,
                   help="dcp: the torch.optim class of the saved optimizer state (default: told from its "
                        "state: Adam, AdamW or SGD)")
    c.add_argument("dst", help="new checkpoint directory")
    c.add_argument("--allow-pickle", action="store_true", help=PICKLE_HELP)
    c.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    progress_flags(c)
    e = sub.add_parser("export", help="write DeepSpeed's universal checkpoint layout, or the model as one "
                                      "safetensors file",
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("--to", dest="target_format", required=True, choices=["deepspeed-universal", "safetensors"],
                   help="format to write")
    e.add_argument("src", help="our checkpoint directory, or a directory with a 'latest' pointer")
    e.add_argument("dst", help="deepspeed-universal: tag folder to write (its parent gets 'latest_universal'); "
                              "safetensors: the file to write")
    e.add_argument("--overwrite", action="store_true", help="write into DST even if it is not empty")
    progress_flags(e)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    run = {"inspect": _inspect, "verify": _verify, "convert": _convert, "export": _export}[args.cmd]
    try:
        return run(args)
    except KeyboardInterrupt:
        print(f"python -m ckpt {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (e.g. "| head"): not a failure
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - every failure becomes a message and an exit code
        code = exc.exit_code if isinstance(exc, CheckpointError) else EXIT_FAILED
        if _is_rank0():
            msg = str(exc) if not isinstance(exc, StateMismatchError) else exc.args[0]
            kind = "" if isinstance(exc, (ManifestError, StepFailedError)) else f"{type(exc).__name__}: "
            print(f"python -m ckpt {args.cmd}: {kind}{msg}", file=sys.stderr)
        return code


def _is_rank0() -> bool:
    if "mpi4py.MPI" not in sys.modules:
        return True
    from mpi4py import MPI

    return not MPI.Is_initialized() or MPI.COMM_WORLD.Get_rank() == 0
