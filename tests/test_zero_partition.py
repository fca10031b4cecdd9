"""Pure partition, planning, checksum and manifest math of ckpt/, with fake ranks and world sizes."""
from __future__ import annotations

import os
import random
import zlib

import numpy as np
import pytest

from ckpt import checksum, plan
from zero import ShardLayout, split_evenly
from ckpt.manifest import FORMAT_VERSION, Manifest, ManifestError, Packer, ParamInfo, jsonable, like

NUMELS = [[7], [35, 7, 21, 3], [1, 1, 1], [0, 5, 0, 9], [4096], [13, 64, 9, 2, 100]]


def _labels(numels):
    """Element labels: (param, index) pairs, as two int arrays per param."""
    return [np.stack([np.full(n, i), np.arange(n)], axis=1) for i, n in enumerate(numels)]


def _reference_rows(numels, world, stage):
    """Rank rows of the padded full buffer built with numpy (label -1 = padding)."""
    labels = _labels(numels)
    if stage == 1:
        flat = np.concatenate(labels) if labels else np.zeros((0, 2), int)
        local = -(-len(flat) // world)
        padded = np.full((local * world, 2), -1)
        padded[:len(flat)] = flat
        return padded.reshape(world, local, 2)
    cols = []
    for lab in labels:
        piece = -(-len(lab) // world)
        padded = np.full((piece * world, 2), -1)
        padded[:len(lab)] = lab
        cols.append(padded.reshape(world, piece, 2))
    return np.concatenate(cols, axis=1)


def _rows_from_layout(layout):
    rows = np.full((layout.world_size, layout.local_numel, 2), -1)
    for r in range(layout.world_size):
        for s in layout.segments(r):
            rows[r, s.local:s.local + s.length, 0] = s.param
            rows[r, s.local:s.local + s.length, 1] = np.arange(s.start, s.start + s.length)
    return rows


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numels", NUMELS, ids=lambda n: "x".join(map(str, n)))
def test_layout_matches_numpy_padding(numels, world, stage):
    layout = ShardLayout(numels, world, stage)
    expected = _reference_rows(numels, world, stage)
    assert layout.local_numel == expected.shape[1]
    assert layout.padded_numel == world * expected.shape[1]
    np.testing.assert_array_equal(_rows_from_layout(layout), expected)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_layout_covers_each_element_once(stage):
    numels = [13, 64, 9, 2, 100, 1]
    for world in range(1, 9):
        layout = ShardLayout(numels, world, stage, param_ids=[10, 11, 12, 13, 14, 15])
        seen = {pid: np.zeros(n, int) for pid, n in zip(layout.param_ids, numels)}
        for r in range(world):
            for s in layout.segments(r):
                assert 0 <= s.local and s.local + s.length <= layout.local_numel
                seen[s.param][s.start:s.start + s.length] += 1
        for pid, counts in seen.items():
            assert (counts == 1).all(), (world, pid, counts)


def test_layout_rejects_bad_arguments():
    with pytest.raises(ValueError, match="stage"):
        ShardLayout([3], 2, 4)
    with pytest.raises(ValueError, match="world_size"):
        ShardLayout([3], 0, 1)
    with pytest.raises(ValueError, match="rank"):
        ShardLayout([3], 2, 1).segments(2)


@pytest.mark.parametrize("total,parts,align", [(0, 3, 1), (10, 3, 1), (100, 7, 8), (5, 8, 4), (4 << 20, 3, 4096)])
def test_split_evenly_tiles_and_aligns(total, parts, align):
    bounds = [split_evenly(total, parts, i, align) for i in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    for (a, b), (c, _) in zip(bounds, bounds[1:]):
        assert b == c and a <= b
        assert b % align == 0 or b == total
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= align


def test_crc32_combine_matches_zlib():
    rng = random.Random(5)
    for i in range(60):
        a = os.urandom(rng.randrange(0, 3000))
        b = os.urandom(rng.randrange(0, 3000) if i % 3 else rng.randrange(60_000, 140_000))
        assert checksum.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
        assert checksum.crc32(a) == zlib.crc32(a)  # the fast path (ISA-L) when installed


def _pieces(data: bytes, cuts, block):
    out = []
    bounds = [0, *cuts, len(data)]
    for a, b in zip(bounds, bounds[1:]):
        for off, ln in checksum.block_ranges(a, b - a, block):
            out.append(checksum.Piece(off, ln, zlib.crc32(data[off:off + ln])))
    return out


def test_block_checksums_do_not_depend_on_who_wrote_what():
    data = os.urandom(10_000)
    block = 1024
    expected = [zlib.crc32(data[i:i + block]) for i in range(0, len(data), block)]
    for cuts in ([], [1], [500, 1500, 1600, 7777], list(range(37, 10_000, 911))):
        pieces = _pieces(data, cuts, block)
        random.Random(1).shuffle(pieces)
        assert checksum.combine_blocks(pieces, len(data), block) == expected


def test_verify_blocks_finds_bad_and_partial_blocks():
    data = bytearray(os.urandom(5000))
    block = 1000
    expected = [zlib.crc32(bytes(data[i:i + block])) for i in range(0, len(data), block)]
    # two "ranks" read overlapping ranges; one duplicate piece; block 4 is touched but not covered
    pieces = _pieces(bytes(data), [300, 2500], block)[:-1]
    pieces += [checksum.Piece(off, ln, zlib.crc32(bytes(data[off:off + ln])))
               for off, ln in checksum.block_ranges(0, 1700, block)]
    pieces.append(checksum.Piece(4000, 10, zlib.crc32(bytes(data[4000:4010]))))
    bad, partial = checksum.verify_blocks(pieces, expected, len(data), block)
    assert bad == [] and partial == [4]
    data[1234] ^= 1
    pieces = _pieces(bytes(data), [300, 2500], block)
    bad, partial = checksum.verify_blocks(pieces, expected, len(data), block)
    assert bad == [1] and partial == []


def test_combine_blocks_reports_a_gap():
    data = os.urandom(3000)
    pieces = [p for p in _pieces(data, [1000, 1500], 1000) if p.offset != 1000]
    with pytest.raises(ValueError, match="block 1"):
        checksum.combine_blocks(pieces, len(data), 1000)


def test_shard_items_map_segments_to_canonical_bytes():
    pk = Packer()
    pk.add("a", 0, "param", (3,), "float16")              # 6 bytes, keeps later offsets odd-aligned
    e1 = pk.add("w", 1, "master", (5, 3), "float32")
    e2 = pk.add("b", 2, "master", (7,), "float32")
    layout = ShardLayout([15, 7], 3, 1, param_ids=[1, 2])  # 22 elements -> 8 per rank
    got = {r: plan.shard_items(layout.segments(r), {1: e1, 2: e2}, buf=r) for r in range(3)}
    assert got[0] == [plan.IOItem(6, 32, 0, 0)]
    assert got[1] == [plan.IOItem(6 + 32, 28, 1, 0), plan.IOItem(e2.offset, 4, 1, 28)]
    assert got[2] == [plan.IOItem(e2.offset + 4, 24, 2, 0)]
    allitems = [it for lst in got.values() for it in lst]
    plan.check_disjoint(allitems)
    assert sum(it.nbytes for it in allitems) == e1.nbytes + e2.nbytes


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_share_items_write_every_byte_once(world):
    items = [plan.IOItem(0, 10, 0, 0), plan.IOItem(10, 4096, 1, 0), plan.IOItem(4106, 3, 2, 0)]
    shares = [plan.share_items(items, world, r, align=1024) for r in range(world)]
    covered = np.zeros(4109, int)
    for lst in shares:
        for it in lst:
            covered[it.offset:it.offset + it.nbytes] += 1
            src = items[it.buf]
            assert it.buf_offset == it.offset - src.offset
    assert (covered == 1).all()


def test_chunk_respects_blocks_and_elements():
    items = [plan.IOItem(6, 100, 0, 0), plan.IOItem(106, 64, 1, 8)]
    pieces = plan.chunk(items, 32, align=16, itemsize={0: 4, 1: 8})
    assert sum(p.nbytes for p in pieces) == 164
    for p in pieces:
        assert p.nbytes <= 32
        elem = 4 if p.buf == 0 else 8
        assert p.nbytes % elem == 0 and (p.offset - items[p.buf].offset) % elem == 0
    raw = plan.chunk(items, 32, align=16)
    assert all(p.offset % 16 == 0 for p in raw if p.offset not in (6, 106))


def test_coalesce_merges_only_true_continuations():
    items = [plan.IOItem(10, 5, 0, 10), plan.IOItem(0, 10, 0, 0), plan.IOItem(15, 5, 1, 0),
             plan.IOItem(20, 5, 1, 9)]
    assert plan.coalesce(items) == [plan.IOItem(0, 15, 0, 0), plan.IOItem(15, 5, 1, 0),
                                    plan.IOItem(20, 5, 1, 9)]


def test_manifest_round_trip_and_validation():
    pk = Packer()
    e = pk.add("w", 0, "master", (2, 3), "float32")
    pk.alias(e, "param")
    pk.add("w", 0, "state", (2, 3), "bfloat16", key="exp_avg")
    m = Manifest(world_size=3, stage=1, step=7, params=[ParamInfo("w", (2, 3), "float32")],
                 tensors=pk.entries, files={"data.bin": {"nbytes": pk.size, "crc32": [123]}},
                 optimizer={"class": "torch.optim.adam.Adam", "param_groups": [{"betas": [0.9, 0.99]}], "scalars": {}},
                 extra={"a": [1, 2]}, block_size=1 << 20)
    m2 = Manifest.from_json(m.to_json())
    assert m2.tensors == m.tensors and m2.params == m.params and m2.extra == {"a": [1, 2]}
    assert m2.find("param", 0).offset == m2.find("master", 0).offset == 0
    assert m2.find("state", 0, "exp_avg").nbytes == 12
    assert m2.state_keys() == ["exp_avg"]
    bad = m.to_json().replace('"nbytes": 12', '"nbytes": 13')
    with pytest.raises(ManifestError, match="expected 12 bytes"):
        Manifest.from_json(bad)
    with pytest.raises(ManifestError, match="version"):
        Manifest.from_json(m.to_json().replace(f'"version": {FORMAT_VERSION}', '"version": 99'))
    with pytest.raises(ManifestError, match="format"):
        Manifest.from_json('{"format": "other"}')


def test_jsonable_and_like():
    assert jsonable({"betas": (0.9, 0.999), "x": None}, "g") == {"betas": [0.9, 0.999], "x": None}
    with pytest.raises(TypeError, match="g.lr"):
        jsonable({"lr": object()}, "g")
    assert like((0.9, 0.99), [0.8, 0.7]) == (0.8, 0.7)
    assert like(0.1, 0.2) == 0.2


def test_batches_group_small_chunks_into_ordered_rounds():
    chunks = [plan.IOItem(0, 10, 0, 0), plan.IOItem(20, 10, 1, 0), plan.IOItem(40, 100, 2, 0),
              plan.IOItem(200, 10, 0, 10), plan.IOItem(215, 30, 1, 10), plan.IOItem(230, 5, 3, 0)]
    got = plan.batches(chunks, alone=lambda c: c.nbytes >= 100, max_bytes=40)
    assert got == [chunks[0:2], [chunks[2]], chunks[3:5], [chunks[5]]]  # last overlaps, so split off
    for b in got:
        assert all(x.offset + x.nbytes <= y.offset for x, y in zip(b, b[1:]))
    assert plan.batches(chunks[:2], alone=lambda c: False, max_bytes=100, max_items=1) == [[chunks[0]], [chunks[1]]]
