"""How ckpt.io groups a rank's byte ranges into collective rounds (pure, no MPI)."""
from __future__ import annotations

from ckpt.io import _plan
from ckpt.byte_ranges import IOItem

MIB = 1 << 20


def test_big_rounds_come_first_so_that_ranks_write_together():
    """Two ranks with shards of the same tensors, one also holding a small header first: round i
    is a big in-place write on both (file order would pair one rank's big write with the other's
    small one, and the ranks would take turns)."""
    big, small = 32 * MIB, 8 << 10
    rank0 = [IOItem(0, 64, 9, 0)]  # the header: staged
    rank1 = []
    pos = 64
    for t in range(4):
        rank0.append(IOItem(pos, big, 2 * t, 0))
        rank1.append(IOItem(pos + big, big, 2 * t, 0))
        pos += 2 * big
        rank0.append(IOItem(pos, small, 2 * t + 1, 0))
        rank1.append(IOItem(pos + small, small, 2 * t + 1, 0))
        pos += 2 * small
    direct = set(range(8))
    r0, r1 = (_plan(items, direct, 32 * MIB, 4 * MIB) for items in (rank0, rank1))
    assert [sum(c.nbytes for c in b) for b in r0[:4]] == [big] * 4
    assert [sum(c.nbytes for c in b) for b in r1[:4]] == [big] * 4
    assert all(c.nbytes < MIB for b in r0[4:] + r1[4:] for c in b)
    for rounds, items in ((r0, rank0), (r1, rank1)):
        key = lambda c: (c.offset, c.nbytes)  # noqa: E731
        assert sorted((c for b in rounds for c in b), key=key) == sorted(items, key=key)


def test_a_staged_round_spans_a_bounded_part_of_the_file():
    """Small ranges far apart are not put in one file view (MPI-IO may read and rewrite the
    whole span between them)."""
    items = [IOItem(k * 100 * MIB, 4096, 0, k * 4096) for k in range(5)]
    rounds = _plan(items, set(), 32 * MIB, 4 * MIB)
    assert len(rounds) == 5
    near = [IOItem(k * MIB, 4096, 0, k * 4096) for k in range(5)]
    assert len(_plan(near, set(), 32 * MIB, 4 * MIB)) == 1
