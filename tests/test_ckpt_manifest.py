"""ckpt's checksums and manifest (pure): per-block checksums whoever wrote
which bytes, and the manifest's JSON round trip and validation."""
from __future__ import annotations

import os
import random
import zlib

import numpy as np
import pytest

from ckpt import checksum, storage
from ckpt.errors import ChecksumError
from ckpt.manifest import FORMAT_VERSION, Manifest, ManifestError, Packer, ParamInfo, jsonable, like


def test_crc32_matches_zlib():
    rng = random.Random(5)
    for i in range(60):
        a = os.urandom(rng.randrange(0, 3000) if i % 3 else rng.randrange(60_000, 140_000))
        assert checksum.crc32(a) == zlib.crc32(a)  # the fast path (ISA-L) when installed


def _pieces(data: bytes, cuts, block):
    out = []
    bounds = [0, *cuts, len(data)]
    for a, b in zip(bounds, bounds[1:]):
        for off, ln in checksum.block_ranges(a, b - a, block):
            out.append(checksum.Piece(off, ln, zlib.crc32(data[off:off + ln])))
    return out


def _combined(pieces, size, block, ranks=1):
    """Block CRCs from ``pieces`` dealt round-robin to ``ranks`` writers, each reducing its own
    share to fixed-size parts (what save does), XOR-ed and summed as the reduction does."""
    shares = [checksum.block_parts(pieces[r::ranks], size, block) for r in range(ranks)]
    parts = np.bitwise_xor.reduce([p for p, _ in shares])
    counts = np.sum([c for _, c in shares], axis=0)
    return checksum.blocks_from_parts(parts, counts, size, block)


def test_block_checksums_do_not_depend_on_who_wrote_what():
    data = os.urandom(10_000)
    block = 1024
    expected = [zlib.crc32(data[i:i + block]) for i in range(0, len(data), block)]  # zlib: the reference
    for cuts in ([], [1], [500, 1500, 1600, 7777], list(range(37, 10_000, 911))):
        pieces = _pieces(data, cuts, block)
        random.Random(1).shuffle(pieces)
        for ranks in (1, 2, 3, 7):
            assert _combined(pieces, len(data), block, ranks) == expected
    assert checksum.zeros_crc(0) == 0 and checksum.zeros_crc(4 << 20) == zlib.crc32(bytes(4 << 20))


def test_verify_data_finds_bad_blocks_and_reads_partial_ones(tmp_path):
    data = bytearray(os.urandom(5000))
    block = 1000
    expected = [zlib.crc32(bytes(data[i:i + block])) for i in range(0, len(data), block)]
    (tmp_path / "data.bin").write_bytes(bytes(data))
    m = Manifest(world_size=1, stage=None, step=None, params=[], tensors=[],
                 files={"data.bin": {"nbytes": len(data), "crc32": expected}}, block_size=block)

    def check(pieces, ranks=2):
        shares = [checksum.block_parts(pieces[r::ranks], len(data), block) for r in range(ranks)]
        storage.verify_data(str(tmp_path), m, np.bitwise_xor.reduce([p for p, _ in shares]),
                            np.sum([c for _, c in shares], axis=0))

    # blocks 0-3 read whole by two "ranks", block 4 only in part (checked from the file)
    check(_pieces(bytes(data), [300, 2500], block)[:-1] + [checksum.Piece(4000, 10, zlib.crc32(bytes(data[4000:4010])))])
    read = bytes(data)
    data[1234] ^= 1  # what a rank read differs from the saved checksum
    with pytest.raises(ChecksumError, match="block 1 "):
        check(_pieces(bytes(data), [300, 2500], block))
    (tmp_path / "data.bin").write_bytes(bytes(data))  # the file itself is damaged in a block read in part
    with pytest.raises(ChecksumError, match="block 1 "):
        check([checksum.Piece(1000, 10, zlib.crc32(read[1000:1010]))])


def test_block_checksums_report_a_gap_or_an_overlap():
    data = os.urandom(3000)
    pieces = [p for p in _pieces(data, [1000, 1500], 1000) if p.offset != 1000]
    with pytest.raises(ValueError, match="block 1"):
        _combined(pieces, len(data), 1000, 2)
    pieces = _pieces(data, [1000, 1500], 1000)
    with pytest.raises(ValueError, match="block 2"):
        _combined(pieces + [pieces[-1]], len(data), 1000, 2)


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


def _full_manifest() -> Manifest:
    pk = Packer()
    pk.add("w", 0, "param", (8, 3), "float32", layout={"mesh": [4], "placements": [["shard", 0]]})
    pk.add("w", 0, "state", (8, 3), "float32", key="exp_avg", layout={"mesh": [2, 2], "placements": [
        ["replicate"], ["strided", 0, 2]]})
    pk.add("b", 1, "param", (3,), "bfloat16")
    pk.add("rng", -1, "item", (5,), "uint8", key="rng/0")
    return Manifest(world_size=4, stage=None, step=3, params=[ParamInfo("w", (8, 3), "float32"),
                                                               ParamInfo("b", (3,), "bfloat16", True)],
                    tensors=pk.entries, files={"data.bin": {"nbytes": pk.size, "crc32": [7, 2**32 - 1]}},
                    optimizer={"class": "torch.optim.adamw.AdamW", "param_groups": [{"params": [0, 1]}],
                               "scalars": {"0": {"step": {"value": 1.0, "dtype": "float32"}}}},
                    extra={"a": 1}, block_size=128, info={"torch": "x"},
                    state={"items": {"rng": {"value": {"@tensor": 0}, "tensors": ["rng/0"]}}})


def test_a_checked_parse_gives_what_the_full_parse_gives():
    """load's other ranks parse rank 0's checked bytes without the checks: the same manifest,
    field by field (the layout and boxes too, which TensorEntry's == leaves out)."""
    from dataclasses import asdict

    text = _full_manifest().to_json()
    full, fast = Manifest.from_json(text), Manifest.from_json(text, checked=True)
    assert asdict(fast) == asdict(full)
    assert [(t.layout, t.boxes) for t in fast.tensors] == [(t.layout, t.boxes) for t in full.tensors]
    assert [type(t.shape) for t in fast.tensors + fast.params] == [tuple] * 6
    assert fast.to_json() == full.to_json() == text


@pytest.mark.parametrize("bad", [True, 1.0, -1, 2**32, "3"])
def test_block_checksums_of_the_wrong_type_or_range_are_refused(bad):
    m = _full_manifest()
    m.files["data.bin"]["crc32"] = [5, bad]
    with pytest.raises(ManifestError, match=r"expected block checksums in \[0, 2\*\*32\), got " + repr(bad)):
        m.validate()
