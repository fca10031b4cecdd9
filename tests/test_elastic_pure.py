"""elastic's pure pieces, no MPI: replica placement, shard joining, the sampler, attribute copies."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from elastic import ElasticSampler, replicas, reshard, values
from zero import ShardLayout


def test_buddy_is_the_next_rank_and_ward_the_previous():
    assert [replicas.buddy(r, 4) for r in range(4)] == [1, 2, 3, 0]
    assert [replicas.ward(r, 4) for r in range(4)] == [3, 0, 1, 2]
    with pytest.raises(ValueError, match="rank=4, world=4"):
        replicas.buddy(4, 4)


@pytest.mark.parametrize("world,survivors,expected", [
    (4, [0, 1, 2, 3], [0, 1, 2, 3]),
    (4, [1, 2, 3], [1, 1, 2, 3]),          # rank 0 lost: its buddy 1 holds it
    (4, [0, 1, 2], [0, 1, 2, 0]),          # rank 3 lost: held by 0 (cyclic)
    (4, [0, 2], [0, 2, 2, 0]),             # two non-adjacent losses
    (4, [0, 3], [0, None, 3, 3]),          # 1 and its buddy 2 both lost
    (3, [2], [None, 2, 2]),
])
def test_holders(world, survivors, expected):
    assert replicas.holders(world, survivors) == expected
    assert replicas.lost_shards(world, survivors) == [s for s, h in enumerate(expected) if h is None]


@pytest.mark.parametrize("domains,expected", [
    ([0, 0, 1, 1], 2),                     # two hosts of two ranks, ranks in blocks
    ([0, 0, 0, 1, 1, 1, 2, 2, 2], 3),
    ([0, 1, 0, 1], 1),                     # ranks dealt round-robin: the next is on the other host
    ([5, 5, 5, 5], 1),                     # one host: the next rank
    ([7], 1),
    ([0, 0, 0, 1], 1),                     # no shift separates more than 2 ranks of 4: the first
])
def test_stride_puts_every_buddy_on_another_host(domains, expected):
    s = replicas.stride(domains)
    assert s == expected
    world = len(domains)
    apart = [domains[r] != domains[replicas.buddy(r, world, s)] for r in range(world)]
    if len(set(domains)) > 1:     # as many ranks separated as by any other shift
        assert sum(apart) == max(sum(domains[r] != domains[(r + t) % world] for r in range(world))
                                 for t in range(1, world))


def test_a_host_lost_whole_loses_no_shard_with_its_stride():
    domains = [0, 0, 0, 1, 1, 1]
    s = replicas.stride(domains)
    assert [replicas.buddy(r, 6, s) for r in range(6)] == [3, 4, 5, 0, 1, 2]
    assert [replicas.ward(r, 6, s) for r in range(6)] == [3, 4, 5, 0, 1, 2]
    assert replicas.holders(6, [3, 4, 5], s) == [3, 4, 5, 3, 4, 5]
    assert replicas.lost_shards(6, [0, 1, 2], s) == []
    assert replicas.lost_shards(6, [3, 4, 5], 1) == [0, 1]      # the next rank is on the same host
    with pytest.raises(ValueError, match="stride=6, world=6"):
        replicas.buddy(0, 6, 6)


def test_holders_rejects_unknown_survivors():
    with pytest.raises(ValueError, match="range\\(3\\)"):
        replicas.holders(3, [0, 5])


def _rows(flat: torch.Tensor, numels: list[int], world: int, stage: int, pad: float) -> torch.Tensor:
    """Every rank's local shard, as ShardLayout's docstring defines it (stage 1: the flat buffer
    padded and split evenly; stage 2: each parameter split on its own into ceil(n / world) pieces)."""
    if stage == 1:
        local = -(-len(flat) // world)
        out = torch.full((world * local,), pad)
        out[:len(flat)] = flat
        return out.view(world, local)
    rows = [[] for _ in range(world)]
    at = 0
    for n in numels:
        piece = -(-n // world)
        for r in range(world):
            part = torch.full((piece,), pad)
            got = flat[at + min(n, r * piece):at + min(n, (r + 1) * piece)]
            part[:len(got)] = got
            rows[r].append(part)
        at += n
    return torch.stack([torch.cat(r) if r else torch.zeros(0) for r in rows])


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("old_world,new_world", [(4, 3), (4, 2), (3, 1), (2, 3), (1, 4), (5, 2), (3, 3), (7, 7)])
def test_pieces_move_every_element_once(stage, old_world, new_world):
    """Every new rank's pieces_to, applied to the old shards, give the new shards as ShardLayout's
    docstring defines them; every old rank's pieces_from are the same pieces, seen from the sender."""
    numels = [7, 1, 12, 0, 5, 30]
    ids = [3, 0, 4, 2, 1, 5]           # ids in another order than the parameters': order is by position
    flat = torch.arange(sum(numels), dtype=torch.float32) + 0.5
    old_rows = _rows(flat, numels, old_world, stage, pad=-1.0)
    want = _rows(flat, numels, new_world, stage, pad=0.0)
    old, new = ShardLayout(numels, old_world, stage, ids), ShardLayout(numels, new_world, stage, ids)
    got = torch.zeros(new_world, new.local_numel)
    incoming = []
    for d in range(new_world):
        ps = reshard.pieces_to(old, new, d)
        assert [p.dst_local for p in ps] == sorted(p.dst_local for p in ps) and {p.dst for p in ps} <= {d}
        for p in ps:
            into = got[p.dst, p.dst_local:p.dst_local + p.length]
            assert p.length > 0 and bool((into == 0).all()), p      # nothing is written twice
            into.copy_(old_rows[p.src, p.src_local:p.src_local + p.length])
        incoming += ps
    assert sum(p.length for p in incoming) == sum(numels)
    assert torch.equal(got, want)
    outgoing = []
    for s in range(old_world):
        ps = reshard.pieces_from(old, new, s)
        assert ps == sorted(ps, key=lambda p: (p.dst, p.dst_local)) and {p.src for p in ps} <= {s}
        outgoing += ps
    assert sorted(outgoing, key=lambda p: (p.dst, p.dst_local)) == sorted(incoming, key=lambda p: (p.dst, p.dst_local))


@pytest.mark.parametrize("stage", [1, 2])
def test_locate_finds_every_element_where_segments_put_it(stage):
    numels = [7, 1, 12, 0, 5]
    layout = ShardLayout(numels, 4, stage)
    where = {}                                  # (param index, element) -> (rank, local)
    for r, seg in layout.all_segments():
        for e in range(seg.length):
            where[(seg.param, seg.start + e)] = (r, seg.local + e)
    for i, n in enumerate(numels):
        for start in range(n):
            for length in range(n - start + 1):
                got = {}
                for r, seg in layout.locate(i, start, length):
                    assert seg.param == i and seg.length > 0
                    for e in range(seg.length):
                        got[(i, seg.start + e)] = (r, seg.local + e)
                assert got == {(i, e): where[(i, e)] for e in range(start, start + length)}
    with pytest.raises(ValueError, match="within the 7 elements of parameter 0"):
        layout.locate(0, 5, 3)
    with pytest.raises(ValueError, match="0 <= index < 5"):
        layout.locate(5, 0, 0)


def test_pieces_need_layouts_of_the_same_parameters():
    with pytest.raises(ValueError, match="same parameters and stage"):
        reshard.pieces_to(ShardLayout([4, 4], 2, 1), ShardLayout([4, 5], 3, 1), 0)
    with pytest.raises(ValueError, match="same parameters and stage"):
        reshard.pieces_from(ShardLayout([4, 4], 2, 1), ShardLayout([4, 4], 3, 2), 0)


def test_split_state():
    master = torch.zeros(6)
    el, other = reshard.split_state({"exp_avg": torch.ones(6), "step": torch.tensor(3.0)}, master)
    assert list(el) == ["exp_avg"] and list(other) == ["step"]


def test_sampler_global_batch_is_independent_of_world():
    s = ElasticSampler(100, 12, seed=3)
    for step in (0, 5, 8, 9, 20):
        g = s.global_indices(step)
        assert len(g) == 12
        for world in (1, 2, 3, 4, 5, 12):
            parts = [s.local_indices(step, r, world) for r in range(world)]
            assert torch.equal(torch.cat(parts), g)
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    # epochs: every sample once per pass of steps_per_epoch steps (the remainder dropped)
    one = torch.cat([s.global_indices(k) for k in range(s.steps_per_epoch)])
    assert len(set(one.tolist())) == 96
    assert not torch.equal(s.global_indices(0), s.global_indices(s.steps_per_epoch))


def test_sampler_loss_scale_gives_the_global_mean():
    s = ElasticSampler(30, 10, shuffle=False)
    per_sample = torch.arange(30, dtype=torch.float64) ** 2
    for world in (1, 2, 3, 4):
        local = [s.loss_scale(world) * per_sample[s.local_indices(1, r, world)].sum() for r in range(world)]
        assert float(sum(local) / world) == pytest.approx(float(per_sample[10:20].mean()))


def test_sampler_errors():
    with pytest.raises(ValueError, match="global_batch_size=0"):
        ElasticSampler(10, 0)
    with pytest.raises(ValueError, match="5 ranks cannot share a global batch of 4"):
        ElasticSampler(10, 4).local_indices(0, 0, 5)


class _Opaque:
    pass


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_values_copy_and_restore():
    g = torch.Generator().manual_seed(1)
    rnd = random.Random(2)
    lin = torch.nn.Linear(2, 2)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(lin.parameters(), lr=1.0), 2)
    items = {"i": 3, "t": torch.ones(2), "d": {"a": [1, torch.zeros(1)]}, "g": g, "r": rnd,
             "s": sched, "n": np.arange(3)}
    saved = {k: values.save(v) for k, v in items.items()}
    expected_g, expected_r = torch.rand(3, generator=g), rnd.random()
    items["t"].add_(5)
    sched.step(), sched.step()
    restored = {k: values.restore(v, saved[k]) for k, v in items.items()}
    assert restored["i"] == 3 and torch.equal(restored["t"], torch.ones(2))
    assert torch.equal(restored["d"]["a"][1], torch.zeros(1))
    assert torch.equal(torch.rand(3, generator=g), expected_g) and rnd.random() == expected_r
    assert sched.last_epoch == 0 and np.array_equal(restored["n"], np.arange(3))


def test_values_check_names_the_attribute():
    with pytest.raises(TypeError, match="attribute 'loader' of type _Opaque cannot be replicated"):
        values.check("loader", _Opaque())
    with pytest.raises(TypeError, match="attribute 'x'"):
        values.check("x", [1, _Opaque()])
