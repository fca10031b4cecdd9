"""elastic.fsdp's N->M reshard of Shard(0) local shards against torch.chunk of the full tensor."""
import pytest
import torch
from torch.distributed.tensor import Shard

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
