"""mpicomm.horovod against independent references (numpy, a single-process torch run), and its
errors: the same error on every rank, never a hang."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mpicomm
import mpicomm.horovod as hvd
from mpitest import assert_all, assert_close_all, check_all


@pytest.fixture
def h(world):
    hvd.init()
    yield hvd


def _grads_reference(steps, n, make, data, opt_of, passes=1):
    """Single process: the gradient averaged over the n ranks' batches, one optimizer."""
    model = make()
    opt = opt_of(model)
    for s in range(steps):
        opt.zero_grad()
        for r in range(n):
            for k in range(passes):
                x, y = data(s, r, k)
                (((model(x) - y) ** 2).mean() / n).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _make():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _data(s, r, k=0):
    g = torch.Generator().manual_seed(1000 * s + 10 * r + k)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("passes", [1, 2])
def test_distributed_optimizer_matches_a_single_process_run(h, passes):
    n, r = h.size(), h.rank()
    model = _make()
    opt = h.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05),
                                 named_parameters=model.named_parameters(),
                                 backward_passes_per_step=passes)
    for s in range(4):
        opt.zero_grad()
        for k in range(passes):
            x, y = _data(s, r, k)
            ((model(x) - y) ** 2).mean().backward()
        opt.step()
    ref = _grads_reference(4, n, _make, _data, lambda m: torch.optim.Adam(m.parameters(), lr=0.05),
                           passes)
    # Horovod averages over ranks and sums the local passes
    for p, q in zip(model.parameters(), ref):
        assert_close_all(p, q.numpy(), rtol=1e-5, atol=1e-6, what="weights")


@pytest.mark.mpi(min_size=2)
def test_fp16_and_onebit_compression_keep_ranks_equal(h):
    for compression in (h.Compression.fp16, h.Compression.onebit):
        model = _make()
        opt = h.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(),
                                     compression=compression)
        for s in range(3):
            opt.zero_grad()
            x, y = _data(s, h.rank())
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        every = h.allgather(flat.unsqueeze(0))
        assert_all(all(torch.equal(every[0], row) for row in every), f"{compression.__name__}")
        ref = _grads_reference(3, h.size(), _make, _data,
                               lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
        ref_flat = torch.cat([q.reshape(-1) for q in ref])
        err = float((flat - ref_flat).abs().max())
        assert_all(err < (2e-3 if compression is h.Compression.fp16 else 0.2), f"{compression}: {err}")


@pytest.mark.mpi(min_size=2)
def test_reducescatter_and_alltoall_match_numpy(h):
    n, r = h.size(), h.rank()
    rows = 2 * n + 1                                     # uneven: the first rank gets one more
    inputs = [np.arange(rows * 3, dtype=np.float64).reshape(rows, 3) * (k + 1) for k in range(n)]
    out = h.reducescatter(torch.from_numpy(inputs[r]), op=h.Sum)
    counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    start = sum(counts[:r])
    assert_close_all(out, sum(inputs)[start:start + counts[r]], what="reducescatter")
    splits = torch.tensor([(r + k) % 3 for k in range(n)], dtype=torch.int32)
    t = torch.arange(int(splits.sum()), dtype=torch.float32) + 100 * r
    got, recv = h.alltoall(t, splits)
    expect, sizes = [], []
    for src in range(n):
        s = [(src + k) % 3 for k in range(n)]
        base = np.arange(sum(s), dtype=np.float32) + 100 * src
        expect.append(base[sum(s[:r]):sum(s[:r]) + s[r]])
        sizes.append(s[r])
    assert_close_all(got, np.concatenate(expect), what="alltoall")
    assert_all(recv.tolist() == sizes and recv.dtype == torch.int32, str(recv))


def _raises_everywhere(kind, text, fn):
    def check():
        with pytest.raises(kind, match=text):
            fn()
    check_all(check)


@pytest.mark.mpi(min_size=2)
def test_mismatches_raise_on_every_rank(h):
    r = h.rank()
    _raises_everywhere(mpicomm.CollectiveMismatchError, "mismatched shapes",
                       lambda: h.allreduce(torch.ones(3 + r)))
    _raises_everywhere(mpicomm.CollectiveMismatchError, "mismatched dtypes",
                       lambda: h.allgather(torch.ones(2, dtype=torch.int32 if r else torch.float32)))
    _raises_everywhere(mpicomm.CollectiveMismatchError, "root_rank",
                       lambda: h.broadcast(torch.ones(2), r))
    _raises_everywhere(mpicomm.CollectiveMismatchError, "do not match",
                       lambda: h.allreduce(torch.ones(2)) if r else h.allgather(torch.ones(2)))
    _raises_everywhere(mpicomm.CollectiveMismatchError, "differently named",
                       lambda: h.allreduce(torch.ones(2), name=f"grad{r}"))
    # a wrong splits on one rank only: that rank raises ValueError, the others a mismatch
    bad = torch.ones(h.size(), dtype=torch.float32 if r == 0 else torch.int32)

    def call():
        h.alltoall(torch.ones(h.size()), bad)
    kind, text = (ValueError, "int32") if r == 0 else (mpicomm.CollectiveMismatchError, "rank")
    _raises_everywhere(kind, text, call)
    assert_all(h.allreduce(torch.ones(1), op=h.Sum).item() == h.size(), "usable afterwards")


@pytest.mark.mpi(min_size=1)
def test_a_name_in_flight_cannot_be_reused_and_adasum_is_refused(h):
    handle = h.allreduce_async(torch.ones(3), name="once")
    check_all(lambda: pytest.raises(ValueError, h.allreduce_async, torch.ones(3), name="once"))
    out = h.synchronize(handle)
    assert_close_all(out, np.full(3, 1.0), what="average of ones")
    h.synchronize(h.allreduce_async(torch.ones(3), name="once"))   # free again once done
    check_all(lambda: pytest.raises(NotImplementedError, h.allreduce, torch.ones(2), op=h.Adasum))
