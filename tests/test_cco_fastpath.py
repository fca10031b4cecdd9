"""The fast-path rule: every dtype x op x layout gives the same bits with the fast paths on and off,
both equal to numpy, and the fast path is taken exactly where the rule says."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cco_data import FLOAT_TORCH, TORCH_DTYPES, reduce_ref, to_f64, tolerance, values
import mpicomm
from mpicomm import fastpath
from mpitest import assert_all, assert_close_all

pytestmark = pytest.mark.mpi(min_size=1)

REDUCING = ["all_reduce", "reduce_scatter_tensor"]
MOVING = ["broadcast", "all_gather_into_tensor", "all_to_all_single"]
CASES = ([(c, op) for c in REDUCING for op in ("sum", "avg", "max", "min", "prod", "band", "bor",
                                                "bxor")]
         + [(c, None) for c in MOVING])
IDS = [f"{c}-{op}" if op else c for c, op in CASES]
BITWISE = ("band", "bor", "bxor")
NATIVE_REDUCE = {torch.float64, torch.float32, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8}


def _layout(data: np.ndarray, dtype, strided: bool) -> torch.Tensor:
    t = torch.from_numpy(data.copy()).to(dtype)
    if not strided:
        return t
    wide = torch.zeros(2 * t.numel(), dtype=dtype)
    wide[::2] = t
    return wide[::2]  # same values, not contiguous


def _run(comm, call, op, dtype, strided, async_op=False):
    """Run ``call`` once (waiting for it when ``async_op``); return (result tensor, float64
    numpy reference)."""
    n, k = comm.size, 3
    comm = _Waiting(comm) if async_op else comm
    world = comm.mpi_comm
    if call == "all_reduce":
        x = _layout(values(comm.rank, 9, dtype, positive=op == "prod"), dtype, strided)
        ref = reduce_ref(np.stack(world.allgather(to_f64(x))), op, dtype == torch.bool)
        comm.all_reduce(x, op=op)
        return x, ref
    if call == "reduce_scatter_tensor":
        x = _layout(values(comm.rank, k * n, dtype, positive=op == "prod"), dtype, strided)
        out = _layout(np.zeros(k), dtype, strided)
        ref = reduce_ref(np.stack(world.allgather(to_f64(x))), op, dtype == torch.bool)
        comm.reduce_scatter_tensor(out, x, op=op)
        return out, ref[comm.rank * k:(comm.rank + 1) * k]
    if call == "broadcast":
        x = _layout(values(comm.rank, 7, dtype, seed=2), dtype, strided)
        ref = world.bcast(to_f64(x), root=n - 1)
        comm.broadcast(x, src=n - 1)
        return x, ref
    if call == "all_gather_into_tensor":
        x = _layout(values(comm.rank, k, dtype, seed=3), dtype, strided)
        out = _layout(np.zeros(k * n), dtype, strided)
        ref = np.concatenate(world.allgather(to_f64(x)))
        comm.all_gather_into_tensor(out, x)
        return out, ref
    x = _layout(values(comm.rank, k * n, dtype, seed=4), dtype, strided)
    out = _layout(np.zeros(k * n), dtype, strided)
    everyone = world.allgather(to_f64(x))
    comm.all_to_all_single(out, x)
    return out, np.concatenate([e[comm.rank * k:(comm.rank + 1) * k] for e in everyone])


class _Waiting:
    """The communicator's calls with ``async_op=True``, each waited for at once."""

    def __init__(self, comm) -> None:
        self._comm = comm
        self.size, self.rank, self.mpi_comm = comm.size, comm.rank, comm.mpi_comm

    def __getattr__(self, name):
        method = getattr(self._comm, name)

        def call(*args, **kwargs):
            work = method(*args, async_op=True, **kwargs)
            assert isinstance(work, mpicomm.Work), f"{name}(async_op=True) gave {work!r}"
            work.wait()
        return call


def _spy_general_paths(comm, monkeypatch) -> list:
    """A list that gets, per call, whether it took the fast path (its general path not called:
    each public method is its general path behind the rule of mpicomm.fastpath)."""
    taken = []
    cls = type(comm)
    for call in REDUCING + MOVING:
        general = getattr(cls, f"_{call}")
        public = getattr(cls, call)

        def spy_general(self, *a, _general=general, **k):
            taken[-1] = False
            return _general(self, *a, **k)

        def spy_public(self, *a, _public=public, **k):
            taken.append(True)
            return _public(self, *a, **k)

        monkeypatch.setattr(cls, f"_{call}", spy_general)
        monkeypatch.setattr(cls, call, spy_public)
    return taken


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("call,op", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=[str(d)[6:] for d in TORCH_DTYPES])
def test_fast_and_general_paths_agree(comm, monkeypatch, dtype, call, op, strided, async_op):
    if op == "avg" and dtype not in FLOAT_TORCH:
        pytest.skip("AVG on integers is an error (test_cco_errors)")
    if op in BITWISE and dtype in FLOAT_TORCH:
        pytest.skip("bitwise ops on floating dtypes are an error (test_cco_errors)")
    taken = _spy_general_paths(comm, monkeypatch)
    fast, ref = _run(comm, call, op, dtype, strided, async_op)
    monkeypatch.setattr(fastpath, "ENABLED", False)
    general, _ = _run(comm, call, op, dtype, strided, async_op)

    expect_fast = not strided and (dtype in NATIVE_REDUCE and op != "avg" if op else True)
    assert_all(taken == [expect_fast, False],
               f"fast path taken {taken}, expected [{expect_fast}, False]")
    assert_all(torch.equal(fast, general), f"fast {fast} != general {general}")
    assert_close_all(to_f64(fast), ref, rtol=tolerance(dtype), what=f"{call} {op}")


def test_fast_path_declines_what_it_cannot_do(comm, monkeypatch):
    # overlapping buffers, numpy arrays, mismatched sizes and invalid roots all go the general way
    taken = _spy_general_paths(comm, monkeypatch)
    buf = torch.full((2 * comm.size,), float(comm.rank))
    comm.all_gather_into_tensor(buf, buf[2 * comm.rank:2 * comm.rank + 2])  # in place: overlaps
    x = np.ones(3, dtype=np.float32)
    comm.all_reduce(x)
    with pytest.raises(ValueError, match="a rank in"):
        comm.broadcast(torch.ones(2), src=comm.size)
    with pytest.raises(ValueError, match="x output.numel"):
        comm.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * comm.size + 1))
    assert_all(taken == [False] * 4, f"fast path taken {taken}")
    assert_all(x.tolist() == [comm.size] * 3, f"numpy all_reduce gave {x}")
    assert_all(buf.tolist() == [float(r) for r in range(comm.size) for _ in range(2)], str(buf))


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
def test_all_reduce_remembers_a_tensor_only_while_it_is_the_same(comm, facts_reader, monkeypatch, async_op):
    """all_reduce reuses the last fast call's MPI buffer for the same tensor; every change of its
    memory, size, dtype, layout or the op is seen (reference: the n ranks' values, chosen so that
    a stale buffer, type or op gives other numbers)."""
    taken = _spy_general_paths(comm, monkeypatch)
    comm = _Waiting(comm) if async_op else comm
    n, r = comm.size, comm.rank
    sums = sum(range(1, n + 1))
    t = torch.full((4,), float(r + 1))
    for _ in range(2):                                   # the same tensor again: remembered
        t.fill_(float(r + 1))
        comm.all_reduce(t)
        assert_all(t.tolist() == [sums] * 4, f"sum {t}")
    t.share_memory_()                                    # other memory, version not counted
    t.fill_(float(r + 1))
    comm.all_reduce(t)
    assert_all(t.tolist() == [sums] * 4, f"after share_memory_ {t}")
    t.resize_(2)                                         # same memory, fewer bytes
    t.fill_(float(r + 1))
    comm.all_reduce(t)
    whole = torch.empty(0).set_(t.untyped_storage())     # the 4 floats the memory holds
    assert_all(whole.tolist() == [sums] * 4, f"after resize_(2) the memory holds {whole}")
    t.set_(torch.full((4,), float(r + 1)))               # other memory, same size
    comm.all_reduce(t)
    assert_all(t.tolist() == [sums] * 4, f"after set_ {t}")
    t.resize_(100)                                       # grown in place (new memory)
    t.fill_(1.0)
    comm.all_reduce(t)
    assert_all(t.tolist() == [float(n)] * 100, f"after resize_ {t}")
    t.data = t.view(torch.int32)                         # same bytes, another dtype
    t.fill_((r + 1) << 23)                               # as float32 bits these add otherwise
    comm.all_reduce(t)
    assert_all(t.dtype == torch.int32 and t.tolist() == [sums << 23] * 100, f"as int32 {t}")
    t.fill_(r + 1)
    comm.all_reduce(t, op="max")                         # another op on the same tensor
    assert_all(t.tolist() == [n] * 100, f"max {t}")
    t.resize_(200)
    t.as_strided_((100,), (1,))
    t.fill_(r + 1)
    comm.all_reduce(t)                                   # remembered: 100 elements from the start
    t.as_strided_((100,), (2,))                          # same address and bytes, every other one
    t.fill_(r + 1)
    comm.all_reduce(t)                                   # not contiguous: the general path
    assert_all(t.tolist() == [sums] * 100, f"strided {t}")
    big = torch.full((fastpath.REMEMBER_BYTES // 4 + 1,), float(r + 1))  # over it: not remembered
    comm.all_reduce(big)
    comm.all_reduce(big)
    assert_all(big.eq(sums * n).all().item(), f"big {big[:3]}")
    assert_all(taken == [True] * 9 + [False, True, True], f"fast path taken {taken}")


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
def test_pair_calls_remember_tensors_only_while_they_are_the_same(comm, facts_reader, monkeypatch, async_op):
    """broadcast, all_gather_into_tensor and reduce_scatter_tensor reuse their last fast call's
    MPI buffers for the same tensors; a change of either tensor's memory, size, dtype or layout,
    or of the op, is seen (reference: numbers computed here from the ranks' values)."""
    taken = _spy_general_paths(comm, monkeypatch)
    c = _Waiting(comm) if async_op else comm
    n, r = comm.size, comm.rank
    out, x = torch.zeros(3 * n), torch.zeros(3)
    gathered = [float(q + 1) for q in range(n) for _ in range(3)]
    for _ in range(2):                                   # the same pair again: remembered
        x.fill_(float(r + 1))
        out.zero_()
        c.all_gather_into_tensor(out, x)
        assert_all(out.tolist() == gathered, f"gather {out}")
    out.share_memory_()                                  # output in other memory, not counted
    out.zero_()
    c.all_gather_into_tensor(out, x)
    assert_all(out.tolist() == gathered, f"gather after share_memory_ {out}")
    x.set_(torch.full((3,), float(r + 2)))               # input in other memory
    c.all_gather_into_tensor(out, x)
    assert_all(out.tolist() == [g + 1 for g in gathered], f"gather after set_ {out}")
    out.data = out.view(torch.int32)                     # output: same bytes, another dtype
    c.all_gather_into_tensor(torch.zeros(3 * n), torch.zeros(3))  # another pair in between
    with pytest.raises(ValueError):                      # dtypes now differ: the general path
        comm.all_gather_into_tensor(out, x)
    sums = sum(range(1, n + 1))
    big, part = torch.ones(2 * n), torch.zeros(2)
    for op, want in (("sum", n), ("sum", n), ("max", 1)):  # remembered, then another op
        big.fill_(1.0)
        c.reduce_scatter_tensor(part, big, op=op)
        assert_all(part.tolist() == [float(want)] * 2, f"{op} {part}")
    big.resize_(4 * n)                                   # input grown (new memory): general
    big.fill_(float(r + 1))
    with pytest.raises(ValueError):
        comm.reduce_scatter_tensor(part, big)
    part.resize_(4)
    c.reduce_scatter_tensor(part, big)
    assert_all(part.tolist() == [float(sums)] * 4, f"resized {part}")
    t = torch.full((5,), float(r))
    for k in range(2):                                   # broadcast: the same tensor again
        t.fill_(float(r + k))
        c.broadcast(t, src=n - 1)
        assert_all(t.tolist() == [float(n - 1 + k)] * 5, f"broadcast {t}")
    t.as_strided_((2,), (2,))                            # same address, not contiguous
    t.fill_(float(r))
    c.broadcast(t, src=n - 1)
    assert_all(t.tolist() == [float(n - 1)] * 2, f"strided broadcast {t}")
    assert_all(taken == [True] * 5 + [False] + [True] * 3 + [False, True] + [True] * 2
               + [False], f"fast path taken {taken}")


def test_a_fresh_communicator_remembers_nothing(comm):
    """Before any fast call, nothing a caller passes looks remembered: None as tensor and op
    gets the general path's error, not an AttributeError."""
    fresh = mpicomm.Communicator(comm.mpi_comm)
    with pytest.raises(TypeError, match="argument \"op\""):
        fresh.all_reduce(None, op=None)


PAIRED = ["all_gather_into_tensor", "reduce_scatter_tensor"]
CHANGES = {  # each keeps the tensor object, its address, its bytes and its dtype
    "swap_tensors": lambda t: torch.utils.swap_tensors(t, torch._neg_view(t.detach())),
    "set_neg": lambda t: torch._C._set_neg(t, True),
    "as_strided_": lambda t: t.as_strided_((t.numel(),), (2,)),
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("call,which", [("all_reduce", "input"), ("broadcast", "input")]
                         + [(c, w) for c in PAIRED for w in ("input", "output")])
def test_remembered_tensor_changed_in_place(comm, facts_reader, monkeypatch, call, which, change):
    """A remembered tensor given the negative bit (swap_tensors, _set_neg) or other strides
    (as_strided_) in place, with its address, bytes and dtype kept, is not moved as the
    remembered call's memory: the results equal numpy's on the values torch reads."""
    taken = _spy_general_paths(comm, monkeypatch)
    n, r, k = comm.size, comm.rank, 3
    nin, nout = {"all_gather_into_tensor": (k, k * n), "reduce_scatter_tensor": (k * n, k)}.get(
        call, (k, k))
    x, out = torch.zeros(2 * nin)[:nin], torch.zeros(2 * nout)[:nout]  # room for stride 2
    everyone = [np.arange(1, nin + 1, dtype=np.float64) * (q + 1) for q in range(n)]

    def run():
        x.copy_(torch.from_numpy(everyone[r]))  # as torch reads it, whatever the layout
        out.zero_()
        if call == "all_reduce":
            comm.all_reduce(x)
            return x, np.sum(everyone, axis=0)
        if call == "broadcast":
            comm.broadcast(x, src=n - 1)
            return x, everyone[n - 1]
        if call == "all_gather_into_tensor":
            comm.all_gather_into_tensor(out, x)
            return out, np.concatenate(everyone)
        comm.reduce_scatter_tensor(out, x)
        return out, np.sum(everyone, axis=0)[r * k:(r + 1) * k]

    for _ in range(2):  # the second call is the remembered one
        got, want = run()
        assert_close_all(got.resolve_neg().double().numpy(), want, rtol=0, atol=0)
    t = out if which == "output" else x
    address = t.data_ptr()
    CHANGES[change](t)
    assert_all(t.data_ptr() == address and t.nbytes == 4 * t.numel() and t.dtype is torch.float32,
               f"{change} changed more than it should")
    got, want = run()
    assert_close_all(got.resolve_neg().double().numpy(), want, rtol=0, atol=0)
    assert_all(taken == [True, True, False], f"fast path taken {taken}")


def test_broadcast_remembers_its_root(comm, facts_reader):
    """The same tensor broadcast from another root is broadcast from that root."""
    n, r = comm.size, comm.rank
    t = torch.zeros(4)
    for src in (0, 0, n - 1, n - 1, 0):
        t.fill_(float(r + 1))
        comm.broadcast(t, src=src)
        assert_all(t.tolist() == [float(src + 1)] * 4, f"broadcast from {src}: {t}")
