"""elastic.fsdp: the N->M reshard of Shard(0) local shards against torch.chunk of the full tensor;
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


@pytest.mark.parametrize("shape", [(10, 3), (7,), (2, 5), (5, 4, 3), (0, 4)])
@pytest.mark.parametrize("old,new", [(4, 3), (3, 2), (2, 3), (4, 1), (1, 4), (3, 3)])
def test_new_shard_matches_torch_chunk(shape, old, new):
    full = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64).reshape(shape)
    rows = _chunks(full, old)
    want = _chunks(full, new)
    for r in range(new):
        got = fsdp.new_shard(shape, (Shard(0),), rows, new, r)
        assert got.shape == want[r].shape
        assert torch.equal(got, want[r])


def test_shard_dim1_matches_torch_chunk():
    full = torch.randn(3, 11, dtype=torch.float64)
    rows = _chunks(full, 4, dim=1)
    for r in range(3):
        assert torch.equal(fsdp.new_shard((3, 11), (Shard(1),), rows, 3, r), _chunks(full, 3, dim=1)[r])


def test_wrong_row_shape_raises():
    rows = [torch.zeros(3), torch.zeros(3), torch.zeros(2)]
    with pytest.raises(ValueError, match="old rank 1"):
        fsdp.new_shard((8,), (Shard(0),), [rows[0], torch.zeros(2), rows[2]], 2, 0)


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


class _OneRankComm:
    """A survivor's communicator whose broadcasts deliver a buffer of another layout (zeros)."""

    rank, size = 0, 2

    def broadcast(self, buf, src):
        if src != self.rank:
            buf.zero_()

    def all_reduce(self, t, op):
        pass


def test_a_buffer_listing_other_tensors_is_refused_not_used():
    entries = [fsdp.Entry(("model", "w"), (7, 3), (Shard(0),), torch.float32)]
    own = torch.empty(fsdp._offsets(entries, 3, 0)[-1], dtype=torch.uint8)
    own[:8].view(torch.int64)[0] = fsdp.digest(entries)
    state = _State()
    state._callbacks.append(fsdp.RebuildFSDP(state, lambda: None))
    c = {"world": 3, "entries": entries, "own": own, "ward": None}
    with pytest.raises(elastic.ElasticError, match="do not list the same parameters"):
        fsdp.rollback(state, c, 1, _OneRankComm(), [0, 2])
