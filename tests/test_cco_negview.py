"""Tensors with torch's negative bit (is_neg()) as inputs and outputs of every collective: the
values land as torch reads them, equal to numpy on resolved copies, with the fast paths on and off."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import mpicomm.distributed as md
from mpicomm import fastpath

pytestmark = pytest.mark.mpi(min_size=1)

CALLS = ["all_reduce", "broadcast", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
         "reduce", "gather", "scatter", "all_to_all_single", "send_recv"]
WHERE = ["input", "output", "both"]


def _vals(rank: int, n: int, seed: int = 0) -> np.ndarray:
    return np.arange(1, n + 1, dtype=np.float64) * (rank + 1) + seed


def _t(data: np.ndarray, neg: bool, dtype=torch.float32) -> torch.Tensor:
    """A tensor that torch reads as ``data``: a neg view of -data when ``neg``."""
    if neg:
        t = torch._neg_view(torch.tensor(-data, dtype=dtype))
        assert t.is_neg()
        return t
    return torch.tensor(data, dtype=dtype)


def _check(got: torch.Tensor, want: np.ndarray) -> None:
    np.testing.assert_allclose(got.resolve_neg().double().numpy(), want, rtol=1e-6)


def _run(comm, call: str, neg_in: bool, neg_out: bool) -> None:
    n, r, k = comm.size, comm.rank, 3
    world = comm.mpi_comm
    every = [_vals(q, k) for q in range(n)]  # what each rank contributes (as torch reads it)
    if call == "all_reduce":  # one buffer, input and output
        x = _t(every[r], neg_in or neg_out)
        comm.all_reduce(x)
        _check(x, np.sum(every, axis=0))
    elif call == "broadcast":  # the root's buffer is the input, the others' the output
        src = n - 1
        x = _t(every[r], neg_in if r == src else neg_out)
        comm.broadcast(x, src=src)
        _check(x, every[src])
    elif call == "all_gather_into_tensor":
        out = _t(np.zeros(k * n), neg_out)
        comm.all_gather_into_tensor(out, _t(every[r], neg_in))
        _check(out, np.concatenate(every))
    elif call == "all_gather":
        outs = [_t(np.zeros(k), neg_out) for _ in range(n)]
        comm.all_gather(outs, _t(every[r], neg_in))
        for q in range(n):
            _check(outs[q], every[q])
    elif call == "reduce_scatter_tensor":
        big = [_vals(q, k * n, seed=1) for q in range(n)]
        out = _t(np.zeros(k), neg_out)
        comm.reduce_scatter_tensor(out, _t(big[r], neg_in))
        _check(out, np.sum(big, axis=0)[r * k:(r + 1) * k])
    elif call == "reduce":
        x = _t(every[r], neg_in if r else neg_out)  # rank 0 (dst) is also written
        comm.reduce(x, dst=0)
        _check(x, np.sum(every, axis=0) if r == 0 else every[r])
    elif call == "gather":
        outs = [_t(np.zeros(k), neg_out) for _ in range(n)] if r == 0 else None
        comm.gather(_t(every[r], neg_in), outs, dst=0)
        if r == 0:
            for q in range(n):
                _check(outs[q], every[q])
    elif call == "scatter":
        parts = [_vals(q, k, seed=5) for q in range(n)]
        out = _t(np.zeros(k), neg_out)
        comm.scatter(out, [_t(p, neg_in) for p in parts] if r == 0 else None, src=0)
        _check(out, parts[r])
    elif call == "all_to_all_single":
        src = [_vals(q, k * n, seed=2) for q in range(n)]
        out = _t(np.zeros(k * n), neg_out)
        comm.all_to_all_single(out, _t(src[r], neg_in))
        _check(out, np.concatenate([src[q][r * k:(r + 1) * k] for q in range(n)]))
    elif call == "send_recv":
        if n == 1:
            pytest.skip("send/recv needs 2 ranks")
        if r == 0:
            comm.send(_t(every[0], neg_in), dst=1)
        elif r == 1:
            out = _t(np.zeros(k), neg_out)
            comm.recv(out, src=0)
            _check(out, every[0])
    world.Barrier()


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "general"])
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("call", CALLS)
def test_neg_view(comm, monkeypatch, call, where, fast):
    monkeypatch.setattr(fastpath, "ENABLED", fast)
    _run(comm, call, where != "output", where != "input")


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
def test_neg_view_async_fast_calls(comm, async_op):
    """The fast-path calls, started non-blocking too, with a neg view as input and output."""
    n, r, k = comm.size, comm.rank, 2
    every = [_vals(q, k) for q in range(n)]
    x = _t(every[r], True)
    work = comm.all_reduce(x, async_op=async_op)
    out = _t(np.zeros(k * n), True)
    work2 = comm.all_gather_into_tensor(out, _t(every[r], True), async_op=async_op)
    for w in (work, work2):
        if w is not None:
            w.wait()
    _check(x, np.sum(every, axis=0))
    _check(out, np.concatenate(every))


def test_in_place_all_gather_neg_input(comm):
    """An input that is a neg view of this rank's own slot of the output is gathered as torch reads it."""
    n, r, k = comm.size, comm.rank, 2
    out = torch.zeros(k * n, dtype=torch.float32)
    out[r * k:(r + 1) * k] = torch.tensor(-_vals(r, k), dtype=torch.float32)
    inp = torch._neg_view(out[r * k:(r + 1) * k])
    comm.all_gather_into_tensor(out, inp)
    _check(out, np.concatenate([_vals(q, k) for q in range(n)]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int32],
                         ids=str)
def test_neg_view_dtypes(comm, dtype):
    """Other dtypes (bf16/fp16 reduce on mpicomm's own 16-bit path) with neg views in and out."""
    n, r, k = comm.size, comm.rank, 4
    every = [_vals(q, k) for q in range(n)]  # small integers: exact in every dtype here
    x = _t(every[r], True, dtype)
    comm.all_reduce(x)
    _check(x, np.sum(every, axis=0))
    big = [_vals(q, k * n, seed=1) for q in range(n)]
    out = _t(np.zeros(k), True, dtype)
    comm.reduce_scatter_tensor(out, _t(big[r], True, dtype))
    _check(out, np.sum(big, axis=0)[r * k:(r + 1) * k])
    gathered = _t(np.zeros(k * n), True, dtype)
    comm.all_gather_into_tensor(gathered, _t(every[r], True, dtype))
    _check(gathered, np.concatenate(every))


@pytest.fixture
def pg():
    md.init_process_group()
    yield
    dist.destroy_process_group()


def test_neg_view_process_group(comm, pg):
    """The same through torch.distributed on the mpicomm process group."""
    n, r, k = comm.size, comm.rank, 2
    every = [_vals(q, k) for q in range(n)]
    x = _t(every[r], True)
    dist.all_reduce(x)
    _check(x, np.sum(every, axis=0))
    y = _t(every[r], True)
    dist.broadcast(y, src=0)
    _check(y, every[0])
    out = _t(np.zeros(k * n), True)
    dist.all_gather_into_tensor(out, _t(every[r], True))
    _check(out, np.concatenate(every))
    outs = [_t(np.zeros(k), True) for _ in range(n)]
    dist.all_gather(outs, _t(every[r], True))
    for q in range(n):
        _check(outs[q], every[q])
    big = [_vals(q, k * n, seed=1) for q in range(n)]
    rs = _t(np.zeros(k), True)
    dist.reduce_scatter_tensor(rs, _t(big[r], True))
    _check(rs, np.sum(big, axis=0)[r * k:(r + 1) * k])
    a2a = _t(np.zeros(k * n), True)
    src = [_vals(q, k * n, seed=2) for q in range(n)]
    dist.all_to_all_single(a2a, _t(src[r], True))
    _check(a2a, np.concatenate([src[q][r * k:(r + 1) * k] for q in range(n)]))


@pytest.mark.parametrize("where", WHERE)
def test_neg_view_compressed_allreduce(comm, where):
    """The 1-bit compressed allreduce reads a neg-view input and writes a neg-view output as
    torch reads them: the same as on plain tensors holding those values."""
    from compressed import Compressor
    from compressed.wire_format import padded_size

    n, r, k = comm.size, comm.rank, 8
    data = _vals(r, k)
    results = []
    for neg_in, neg_out in ((False, False), (where != "output", where != "input")):
        out = _t(np.zeros(k), neg_out)
        we = torch.zeros(padded_size(k, n))
        se = torch.zeros(padded_size(k, n) // n)
        Compressor(comm).allreduce_into(_t(data, neg_in), out, we, se)
        results.append(out.resolve_neg().double().numpy())
    np.testing.assert_array_equal(results[1], results[0])


def test_neg_view_compressed_error_buffer_refused(comm):
    from compressed import Compressor
    from compressed.wire_format import padded_size

    n, k = comm.size, 8
    we = torch._neg_view(torch.zeros(padded_size(k, n)))
    se = torch.zeros(padded_size(k, n) // n)
    with pytest.raises(ValueError, match=r"worker_error must not be a tensor with torch's "
                                         r"negative bit set \(is_neg\(\)\): pass "
                                         r"worker_error.resolve_neg\(\)"):
        Compressor(comm).allreduce_into(torch.ones(k), torch.zeros(k), we, se)


@pytest.mark.parametrize("call", ["all_reduce", "broadcast", "all_gather_into_tensor",
                                  "reduce_scatter_tensor"])
def test_remembered_tensor_turned_neg(comm, facts_reader, call):
    """A tensor a fast call remembers, turned into a neg view of its own memory by ``.data =``
    (same address, size and dtype), is not moved by its raw bits on the next call."""
    n, r, k = comm.size, comm.rank, 2
    x = torch.tensor(_vals(r, k * n), dtype=torch.float32)
    out = torch.zeros(k * n if call == "all_gather_into_tensor" else k, dtype=torch.float32)
    small = torch.tensor(_vals(r, k), dtype=torch.float32)

    def run():
        if call == "all_reduce":
            comm.all_reduce(small)
        elif call == "broadcast":
            comm.broadcast(small, src=0)
        elif call == "all_gather_into_tensor":
            comm.all_gather_into_tensor(out, small)
        else:
            comm.reduce_scatter_tensor(out, x)

    run()  # remembered
    for t in (small, x):
        t.data = torch.tensor(-_vals(r, t.numel()), dtype=torch.float32)
    run()  # fresh memory: remembered again
    for t in (small, x):
        t.copy_(torch.tensor(-_vals(r, t.numel())))  # in place: the same memory
        t.data = torch._neg_view(t.detach())  # same memory, now read as _vals again
        assert t.is_neg()
    every = comm.mpi_comm.allgather(_vals(r, k))
    big = comm.mpi_comm.allgather(_vals(r, k * n))
    run()
    if call == "all_reduce":
        _check(small, np.sum(every, axis=0))
    elif call == "broadcast":
        _check(small, every[0])
    elif call == "all_gather_into_tensor":
        _check(out, np.concatenate(every))
    else:
        _check(out, np.sum(big, axis=0)[r * k:(r + 1) * k])
