"""ckpt's byte ranges (pure, fake ranks): a shard's segments to file bytes, replicated bytes
shared so each is written once, chunks on block and element bounds, coalescing, rounds."""
from __future__ import annotations

import numpy as np
import pytest

from ckpt.byte_ranges import IOItem, batches, check_disjoint, chunk, coalesce, share_items, shard_items
from ckpt.manifest import Packer
from zero import ShardLayout


def test_shard_items_map_segments_to_canonical_bytes():
    pk = Packer()
    pk.add("a", 0, "param", (3,), "float16")              # 6 bytes, keeps later offsets odd-aligned
    e1 = pk.add("w", 1, "master", (5, 3), "float32")
    e2 = pk.add("b", 2, "master", (7,), "float32")
    layout = ShardLayout([15, 7], 3, 1, param_ids=[1, 2])  # 22 elements -> 8 per rank
    got = {r: shard_items(layout.segments(r), {1: e1, 2: e2}, buf=r) for r in range(3)}
    assert got[0] == [IOItem(6, 32, 0, 0)]
    assert got[1] == [IOItem(6 + 32, 28, 1, 0), IOItem(e2.offset, 4, 1, 28)]
    assert got[2] == [IOItem(e2.offset + 4, 24, 2, 0)]
    allitems = [it for lst in got.values() for it in lst]
    check_disjoint(allitems)
    assert sum(it.nbytes for it in allitems) == e1.nbytes + e2.nbytes


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_share_items_write_every_byte_once(world):
    items = [IOItem(0, 10, 0, 0), IOItem(10, 4096, 1, 0), IOItem(4106, 3, 2, 0)]
    shares = [share_items(items, world, r, align=1024) for r in range(world)]
    covered = np.zeros(4109, int)
    for lst in shares:
        for it in lst:
            covered[it.offset:it.offset + it.nbytes] += 1
            src = items[it.buf]
            assert it.buf_offset == it.offset - src.offset
    assert (covered == 1).all()


def test_chunk_respects_blocks_and_elements():
    items = [IOItem(6, 100, 0, 0), IOItem(106, 64, 1, 8)]
    pieces = chunk(items, 32, align=16, itemsize={0: 4, 1: 8})
    assert sum(p.nbytes for p in pieces) == 164
    for p in pieces:
        assert p.nbytes <= 32
        elem = 4 if p.buf == 0 else 8
        assert p.nbytes % elem == 0 and (p.offset - items[p.buf].offset) % elem == 0
    raw = chunk(items, 32, align=16)
    assert all(p.offset % 16 == 0 for p in raw if p.offset not in (6, 106))


def test_coalesce_merges_only_true_continuations():
    items = [IOItem(10, 5, 0, 10), IOItem(0, 10, 0, 0), IOItem(15, 5, 1, 0), IOItem(20, 5, 1, 9)]
    assert coalesce(items) == [IOItem(0, 15, 0, 0), IOItem(15, 5, 1, 0), IOItem(20, 5, 1, 9)]


def test_batches_group_small_chunks_into_ordered_rounds():
    chunks = [IOItem(0, 10, 0, 0), IOItem(20, 10, 1, 0), IOItem(40, 100, 2, 0),
              IOItem(200, 10, 0, 10), IOItem(215, 30, 1, 10), IOItem(230, 5, 3, 0)]
    got = batches(chunks, alone=lambda c: c.nbytes >= 100, max_bytes=40)
    assert got == [chunks[0:2], [chunks[2]], chunks[3:5], [chunks[5]]]  # last overlaps, so split off
    for b in got:
        assert all(x.offset + x.nbytes <= y.offset for x, y in zip(b, b[1:]))
    assert batches(chunks[:2], alone=lambda c: False, max_bytes=100, max_items=1) == [[chunks[0]], [chunks[1]]]
