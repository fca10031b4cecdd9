"""How zero's ShardLayout partitions parameters over ranks (checked against numpy padding, with
fake world sizes), and split_evenly's even, aligned shares."""
from __future__ import annotations

import numpy as np
import pytest

from zero import ShardLayout, split_evenly

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
