"""Command line: ``python -m ckpt inspect|verify PATH`` (no MPI needed)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .api import read_manifest, resolve
from .io import read_blocks
from .manifest import DATA_NAME, FORMAT_VERSION


def _inspect(args: argparse.Namespace) -> int:
    m = read_manifest(args.path)
    if args.json:
        print(m.to_json())
        return 0
    f = m.files[DATA_NAME]
    print(f"checkpoint {resolve(args.path)}")
    print(f"  format version {FORMAT_VERSION}, saved by {m.world_size} rank(s), "
          f"stage {m.stage if m.stage is not None else '-'}, step {m.step}")
    print(f"  {len(m.params)} model tensors, {sum(_numel(p.shape) for p in m.params):,} elements; "
          f"data {f['nbytes']:,} bytes in {len(f['crc32'])} block(s) of {m.block_size:,}")
    if m.optimizer:
        print(f"  optimizer {m.optimizer['class']}, state keys {m.state_keys()}, "
              f"{len(m.optimizer['param_groups'])} param group(s)")
        for i, g in enumerate(m.optimizer["param_groups"]):
            hp = {k: v for k, v in g.items() if k != "params"}
            print(f"    group {i}: {len(g['params'])} params, {hp}")
    if m.extra is not None:
        print(f"  extra {json.dumps(m.extra)}")
    if args.tensors:
        print(f"  {'kind':<8} {'key':<12} {'dtype':<9} {'offset':>14} {'nbytes':>12}  name shape")
        for t in m.tensors:
            print(f"  {t.kind:<8} {t.key or '-':<12} {t.dtype:<9} {t.offset:>14} {t.nbytes:>12}  "
                  f"{t.name} {list(t.shape)}")
    return 0


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _verify(args: argparse.Namespace) -> int:
    m = read_manifest(args.path)
    f = m.files[DATA_NAME]
    size = int(f["nbytes"])
    blocks = list(range(len(f["crc32"])))
    crcs = read_blocks(os.path.join(resolve(args.path), DATA_NAME), blocks, m.block_size, size)
    bad = [b for b, c in zip(blocks, crcs) if c != f["crc32"][b]]
    if bad:
        print(f"BAD: {len(bad)} of {len(blocks)} blocks fail their checksum: {bad[:20]}")
        return 1
    print(f"ok: {len(blocks)} blocks, {size:,} bytes")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckpt", description="Inspect or verify a checkpoint.")
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("inspect", help="print the manifest's summary")
    i.add_argument("path", help="checkpoint directory, or a directory with a 'latest' pointer")
    i.add_argument("--tensors", action="store_true", help="list every tensor entry")
    i.add_argument("--json", action="store_true", help="print the manifest itself")
    v = sub.add_parser("verify", help="read every block and check its CRC-32")
    v.add_argument("path")
    args = p.parse_args(argv)
    try:
        return _inspect(args) if args.cmd == "inspect" else _verify(args)
    except (OSError, ValueError) as exc:
        print(f"python -m ckpt {args.cmd}: {exc}", file=sys.stderr)
        return 2
