"""elastic.fsdp: the N->M re-partition plan of packed local shards against torch.chunk of the full tensors;
the packed commit buffer; the errors a recovery raises before any collective."""
import pytest
import torch
from torch.distributed.tensor import Shard

import elastic
from elastic import fsdp


def _chunks(full, world, dim=0):
    parts = list(torch.chunk(full, world, dim=dim))
    while len(parts) < world:  # torch.chunk may give fewer pieces; FSDP2 pads with empty shards
        shape = list(full.shape)
        shape[dim] = 0
        parts.append(full.new_empty(shape))
    return parts


def _pack(entries, fulls, world, rank, dims):
    """Old rank ``rank``'s packed buffer, its local shards cut by torch.chunk (the reference)."""
    offs = fsdp._offsets(entries, world, rank)
    buf = torch.zeros(offs[-1], dtype=torch.uint8)
    for e, f, lo, dim in zip(entries, fulls, offs, dims):
        fsdp._view(buf, e, lo, world, rank).copy_(_chunks(f, world, dim)[rank])
    return buf


def _moved(entries, fulls, old, new, dims):
    """Every new rank's packed buffer, filled from the old ranks' by ``fsdp.plan`` alone."""
    rows = [_pack(entries, fulls, old, s, dims) for s in range(old)]
    out = [torch.zeros(fsdp._offsets(entries, new, r)[-1], dtype=torch.uint8) for r in range(new)]
    for p in fsdp.plan(entries, old, new):
        into = out[p.dst][p.dst_local:p.dst_local + p.length]
        into.copy_(rows[p.src][p.src_local:p.src_local + p.length])
    return out


@pytest.mark.parametrize("old,new", [(4, 3), (3, 2), (2, 3), (4, 1), (1, 4), (3, 3)])
def test_plan_moves_shards_as_torch_chunk_cuts_them(old, new):
    """Shard(0) tensors of several shapes and dtypes (empty ones, fewer rows than ranks) and a
    Shard(1) one: the new ranks' shards are torch.chunk's of the full tensors."""
    shapes = [(10, 3), (7,), (2, 5), (5, 4, 3), (0, 4), (3, 11)]
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.float16, torch.float32]
    dims = [0, 0, 0, 0, 0, 1]
    entries = [fsdp.Entry(("model", f"p{i}"), shape, (Shard(dim),), dt)
               for i, (shape, dt, dim) in enumerate(zip(shapes, dtypes, dims))]
    fulls = [(torch.arange(int(torch.tensor(shape).prod())) + 1).reshape(shape).to(dt)
             for shape, dt in zip(shapes, dtypes)]
    got = _moved(entries, fulls, old, new, dims)
    for r in range(new):
        offs = fsdp._offsets(entries, new, r)
        for e, f, lo, dim in zip(entries, fulls, offs, dims):
            want = _chunks(f, new, dim)[r]
            shard = fsdp._view(got[r], e, lo, new, r)
            assert shard.shape == want.shape and torch.equal(shard, want), (e.key, r)


@pytest.mark.parametrize("old,new", [(4, 3), (2, 5), (5, 5), (7, 2)])
def test_one_ranks_plan_is_its_share_of_the_full_plan(old, new):
    """plan(dst=...) / plan(srcs=...), found from the chunk arithmetic, against the full plan."""
    shapes = [(10, 3), (7,), (2, 5), (0, 4), (3, 11), (40, 2)]
    dims = [0, 0, 0, 0, 1, 0]
    entries = [fsdp.Entry(("model", f"p{i}"), shape, (Shard(dim),), torch.float32)
               for i, (shape, dim) in enumerate(zip(shapes, dims))]
    full = fsdp.plan(entries, old, new)
    key = lambda p: (p.src, p.dst, p.dst_local)       # noqa: E731
    for d in range(new):
        assert sorted(fsdp.plan(entries, old, new, dst=d), key=key) == sorted((p for p in full if p.dst == d), key=key)
    for srcs in ([0], [old - 1], [0, old - 1], list(range(old))):
        got = sorted(fsdp.plan(entries, old, new, srcs=srcs), key=key)
        assert got == sorted((p for p in full if p.src in srcs), key=key)


def test_plan_moves_every_byte_once():
    entries = [fsdp.Entry(("model", "w"), (9, 2), (Shard(0),), torch.float32),
               fsdp.Entry(("optim", "w", "exp_avg"), (9, 2), (Shard(0),), torch.float32)]
    for old, new in [(4, 3), (2, 5)]:
        moved = sum(p.length for p in fsdp.plan(entries, old, new))
        assert moved == 2 * 9 * 2 * 4
        seen = set()
        for p in fsdp.plan(entries, old, new):
            span = {(p.dst, b) for b in range(p.dst_local, p.dst_local + p.length)}
            assert not span & seen, p
            seen |= span


def test_packed_pieces_of_mixed_dtypes_read_back():
    """A commit's buffer: every old rank's local shards of several dtypes, aligned, read back."""
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.float16]
    entries = [fsdp.Entry(("model", f"p{i}"), (5 + i, 3), (Shard(0),), dt) for i, dt in enumerate(dtypes)]
    fulls = [torch.arange(15 + 3 * i).reshape(5 + i, 3).to(dt) for i, dt in enumerate(dtypes)]
    for world in (1, 3, 4):
        for rank in range(world):
            offs = fsdp._offsets(entries, world, rank)
            assert all(o % 8 == 0 for o in offs)
            buf = torch.empty(offs[-1], dtype=torch.uint8)
            mine = [_chunks(f, world)[rank] for f in fulls]
            for e, t, lo in zip(entries, mine, offs):
                fsdp._view(buf, e, lo, world, rank).copy_(t)
            for e, t, lo in zip(entries, mine, offs):
                got = fsdp._view(buf, e, lo, world, rank)
                assert got.dtype == t.dtype and torch.equal(got, t)


class _State:
    """What rollback reads of a TorchState before any collective."""

    def __init__(self, callbacks=()):
        self._callbacks = list(callbacks)


def test_a_shard_and_its_buddy_both_lost_is_named():
    state = _State()
    state._callbacks.append(fsdp.RebuildFSDP(state, lambda: None))
    c = {"world": 4, "entries": [], "own": torch.empty(0, dtype=torch.uint8), "ward": None}
    with pytest.raises(elastic.ShardsLostError, match=r"FSDP2 shards of old ranks \[1\]") as info:
        fsdp.rollback(state, c, 1, None, [0, 3])    # rank 1's buddy is rank 2
    assert info.value.lost == [1]


def test_a_recovery_without_rebuild_fsdp_says_what_to_register():
    c = {"world": 3, "entries": [], "own": torch.empty(0, dtype=torch.uint8), "ward": None}
    with pytest.raises(elastic.ElasticError, match=r"register elastic.RebuildFSDP\(state, build\)"):
        fsdp.rollback(_State(), c, 1, None, [0, 2])


def test_rebuild_fsdp_checks_its_arguments():
    state = _State()
    with pytest.raises(TypeError, match="build\\(\\) -> \\(model, optimizer\\)"):
        elastic.RebuildFSDP(state, 5)
    rebuild = elastic.RebuildFSDP(state, lambda: None)
    state._fsdp_pending = None
    with pytest.raises(elastic.ElasticError, match="no recovery of an FSDP2 state is pending"):
        rebuild()


def test_plain_models_are_not_fsdp():
    assert not fsdp.uses_dtensors(None)
    assert not fsdp.uses_dtensors(torch.nn.Linear(2, 3))


class _Comm:
    fault_tolerant = True


def test_a_commit_under_ulfm_without_rebuild_fsdp_is_refused():
    state = _State()
    state.comm, state._fsdp_pending = _Comm(), None
    with pytest.raises(ValueError, match=r"register elastic.RebuildFSDP\(state, build\)"):
        fsdp.commit(state, None)


def test_a_commit_before_the_rebuild_is_refused():
    state = _State()
    state.comm, state._fsdp_pending = _Comm(), {"count": 3}
    with pytest.raises(elastic.ElasticError, match="not rebuilt after the recovery"):
        fsdp.commit(state, None)


class _OtherDigestComm:
    """A survivor's communicator on which the other survivor lists other tensors (its digest
    and its held buffers' are 0); it has no point-to-point calls, so nothing may be exchanged."""

    rank, size = 0, 2

    def all_reduce(self, t, op):
        t.copy_(torch.minimum(t, torch.zeros_like(t)))


def test_a_buffer_listing_other_tensors_is_refused_not_used():
    entries = [fsdp.Entry(("model", "w"), (7, 3), (Shard(0),), torch.float32)]
    own = torch.empty(fsdp._offsets(entries, 3, 0)[-1], dtype=torch.uint8)
    own[:8].view(torch.int64)[0] = fsdp.digest(entries)
    state = _State()
    state._callbacks.append(fsdp.RebuildFSDP(state, lambda: None))
    c = {"world": 3, "entries": entries, "own": own, "ward": None}
    with pytest.raises(elastic.ElasticError, match="do not list the same parameters"):
        fsdp.rollback(state, c, 1, _OtherDigestComm(), [0, 2])
