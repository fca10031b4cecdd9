"""OnebitAllreduce: owned error buffers, identity at one rank, dtypes, empty and non-finite input."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import compressed
from mpitest import check_all
from test_cmp_backend import compare, group, simulate


@pytest.mark.mpi(min_size=1)
def test_matches_simulation_with_errors_kept_per_key(world, comm):
    def run():
        ar = compressed.OnebitAllreduce(comm)
        p = comm.size
        rng = np.random.default_rng(comm.rank)
        state = {}
        for step in range(3):
            for key, shape in (("a", (5, 20)), ("b", (33,))):
                n = int(np.prod(shape))
                g = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
                N = compressed.padded_size(n, p)
                we, se = state.get(key, (np.zeros(N), np.zeros(N // p)))
                ref = simulate(g.numpy(), we, se, world)
                before = g.clone()
                out = ar(g, key=key)
                assert torch.equal(g, before), "input was modified"
                assert out.shape == shape and out.dtype == torch.float32
                if p == 1:
                    assert torch.equal(out, g)
                    continue
                wt, st = ar.errors(key)
                compare(out, wt, st, ref)
                state[key] = (wt.numpy().astype(np.float64), st.numpy().astype(np.float64))
        assert sorted(ar.keys()) == ([] if p == 1 else ["a", "b"])

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
def test_world_size_one_is_identity(world):
    sub, comm1 = group(world, 1)

    def run():
        if comm1 is None:
            return
        ar = compressed.OnebitAllreduce(comm1)
        x = torch.randn(3, 5, dtype=torch.bfloat16)
        out = ar(x, key="k")
        assert torch.equal(out, x) and out.dtype == torch.bfloat16 and out.data_ptr() != x.data_ptr()
        assert ar.keys() == []

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes_computed_in_fp32_and_returned_in_theirs(world, comm, dtype):
    def run():
        ar = compressed.OnebitAllreduce(comm)
        p = comm.size
        torch.manual_seed(10 + comm.rank)
        g = torch.randn(300).to(dtype)
        N = compressed.padded_size(300, p)
        ref = simulate(g.float().numpy(), np.zeros(N), np.zeros(N // p), world)
        out = ar(g, key="h")
        assert out.dtype == dtype
        if p > 1:
            we, se = ar.errors("h")
            compare(out, we, se, ref, out_rtol=1e-2 if dtype != torch.float64 else 2e-6)

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
def test_empty_and_size_checks(world, comm):
    def run():
        ar = compressed.OnebitAllreduce(comm)
        out = ar(torch.zeros(0, 4), key="e")
        assert out.shape == (0, 4)
        with pytest.raises(TypeError, match="floating"):
            ar(torch.zeros(4, dtype=torch.int64))
        if comm.size > 1:
            ar(torch.ones(10), key="x")
            with pytest.raises(ValueError, match="key 'x' holds error buffers"):
                ar(torch.ones(1000), key="x")
            ar.reset("x")
            ar(torch.ones(1000), key="x")

    check_all(run, world)


@pytest.mark.mpi(min_size=2)
def test_non_finite_raises_on_every_rank(world, comm):
    def run():
        ar = compressed.OnebitAllreduce(comm)
        x = torch.randn(64)
        ar(x, key="k")
        we, se = (t.clone() for t in ar.errors("k"))
        y = torch.randn(64)
        if comm.rank == 0:
            y[3] = float("inf")
        with pytest.raises(compressed.NonFiniteError, match=r"not finite .* rank\(s\) \[0\]"):
            ar(y, key="k")
        assert torch.equal(ar.errors("k")[0], we) and torch.equal(ar.errors("k")[1], se)

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
def test_state_dict_round_trip_continues_identically(world, comm):
    def run():
        a = compressed.OnebitAllreduce(comm)
        rng = np.random.default_rng(comm.rank)
        xs = [torch.from_numpy(rng.standard_normal(200).astype(np.float32)) for _ in range(4)]
        a(xs[0], key="w")
        a(xs[1], key="w")
        b = compressed.OnebitAllreduce(comm)
        b.load_state_dict(a.state_dict())
        for x in xs[2:]:
            assert torch.equal(a(x, key="w"), b(x, key="w"))
        if comm.size > 1:
            assert torch.equal(a.errors("w")[0], b.errors("w")[0])
        bad = dict(a.state_dict(), world_size=comm.size + 1)
        with pytest.raises(ValueError, match="world size"):
            b.load_state_dict(bad)

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kernels", ["numpy", "numba"])
@pytest.mark.parametrize("inplace", [False, True])
def test_consecutive_calls_with_deferred_updates_match_simulation(world, comm, kernels, inplace):
    """Calls back to back (errors not inspected in between, so updates stay deferred) follow
    the simulation, which carries its own float64 errors; the errors match at the end."""
    if kernels == "numba":
        pytest.importorskip("numba")

    def run():
        if True:
            ar = compressed.OnebitAllreduce(comm, kernels=kernels)
            p = comm.size
            rng = np.random.default_rng(40 + comm.rank)
            states = {}
            for step in range(4):
                for key, n in (("a", 4096 * 2 + 40), ("b", 4096 * 2 + 40), ("c", 77)):
                    g = torch.from_numpy((rng.standard_normal(n) + 0.1 * comm.rank).astype(np.float32))
                    N = compressed.padded_size(n, p)
                    we, se = states.get(key, (np.zeros(N), np.zeros(N // p)))
                    ref = simulate(g.numpy(), we, se, world)
                    states[key] = (ref["we"], ref["se"])
                    if inplace:
                        out = g.clone()
                        assert ar.allreduce_(out, key=key) is out
                    else:
                        out = ar(g, key=key)
                    if p == 1:
                        assert torch.equal(out, g)
                        continue
                    # errors are checked below (asking for them applies the deferred updates)
                    compare(out, ref["we"], ref["se"], ref)
            if p > 1:
                for key in ("a", "b", "c"):
                    wt, st = ar.errors(key)
                    np.testing.assert_allclose(wt.numpy(), states[key][0], rtol=0, atol=1e-5)
                    np.testing.assert_allclose(st.numpy(), states[key][1], rtol=0, atol=1e-5)

    check_all(run, world)


def test_result_memory_reuses_only_unreferenced_blocks():
    from compressed.allreduce import _ResultMemory

    mem = _ResultMemory()
    shape = torch.Size([1 << 18])
    a = mem.empty(shape, torch.float32)
    b = mem.empty(shape, torch.float32)
    assert b.data_ptr() != a.data_ptr(), "a live result's memory was handed out again"
    view, arr = a[7:], b.numpy()[3:]
    del a, b
    c = mem.empty(shape, torch.float32)
    assert c.data_ptr() not in (view.data_ptr() - 28, arr.ctypes.data - 12)
    ptr = c.data_ptr()
    del c
    d = mem.empty(shape, torch.float32)
    assert d.data_ptr() == ptr, "a dropped result's memory was not reused"
    e = mem.empty(torch.Size([256, 1024]), torch.bfloat16)
    assert e.dtype == torch.bfloat16 and e.shape == (256, 1024) and e.is_contiguous()


@pytest.mark.mpi(min_size=1)
def test_results_are_never_overwritten_while_referenced(world, comm):
    def run():
        ar = compressed.OnebitAllreduce(comm)
        n = 300_000  # above the size where result memory is recycled
        rng = np.random.default_rng(comm.rank)
        xs = [torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for _ in range(3)]
        first = ar(xs[0], key="r")
        kept_view = first[10:]
        kept = kept_view.clone()
        del first
        second = ar(xs[1], key="r")
        assert torch.equal(kept_view, kept)
        del second
        third = ar(xs[2], key="r")
        assert torch.equal(kept_view, kept) and third.shape == (n,)

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("deferred", [False, True])
def test_pipelined_pieces_match_simulation(world, comm, deferred, monkeypatch):
    """Work split in many small pieces (between MPI progress calls) gives the same results."""
    from compressed import wire_format as layout

    monkeypatch.setattr(layout, "PIECE_BYTES", 24)  # restored after the test
    monkeypatch.setattr(layout, "MAX_PIECES", 1000)
    monkeypatch.setattr(compressed.compressor, "_one_node", lambda comm: False)  # pieces on 1 node
    monkeypatch.setattr(compressed.engine, "STEP_BYTES", 8)  # many progress steps per piece

    def run():
        p = comm.size
        n = 1003
        N = compressed.padded_size(n, p)
        rng = np.random.default_rng(70 + comm.rank)
        ar = compressed.OnebitAllreduce(comm)
        be = compressed.MpiBackend(comm=comm)
        we, se = torch.zeros(N), torch.zeros(N // p)
        state = (np.zeros(N), np.zeros(N // p))
        for _ in range(3):
            g = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
            ref = simulate(g.numpy(), *state, world)
            state = (ref["we"], ref["se"])
            if p == 1:
                continue
            if deferred:
                compare(ar(g, key="k"), ref["we"], ref["se"], ref)
            else:
                compare(be.compressed_allreduce(g.clone(), we, se, 0), we, se, ref)
        if deferred and p > 1:
            wt, st = ar.errors("k")
            np.testing.assert_allclose(wt.numpy(), state[0], rtol=0, atol=1e-5)
            np.testing.assert_allclose(st.numpy(), state[1], rtol=0, atol=1e-5)

    check_all(run, world)


@pytest.mark.mpi(min_size=2)
def test_checking_mode_reports_size_mismatch(world):
    def run():
        import mpicomm

        comm = mpicomm.Communicator(world, check=True)
        n = 100 + 8 * comm.size * comm.rank  # padded sizes differ between ranks
        be = compressed.MpiBackend(comm=comm)
        N = compressed.padded_size(n, comm.size)
        with pytest.raises(mpicomm.CollectiveMismatchError, match="do not agree"):
            be.compressed_allreduce(np.ones(n, np.float32), np.zeros(N, np.float32),
                                    np.zeros(N // comm.size, np.float32), 0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", [False, True])
def test_sizes_that_pad_alike_still_raise_everywhere(world, check):
    """Sizes that differ but pad to the same length travel in the trailer: every rank raises,
    in or out of checking mode, and no buffer changes."""
    def run():
        import mpicomm

        comm = mpicomm.Communicator(world, check=check)
        n = 100 + comm.rank  # same padded size (a multiple of 8 * size) on every rank
        be = compressed.MpiBackend(comm=comm)
        N = compressed.padded_size(n, comm.size)
        assert N == compressed.padded_size(100, comm.size)
        buf, we, se = np.ones(n, np.float32), np.zeros(N, np.float32), np.zeros(N // comm.size, np.float32)
        with pytest.raises(compressed.SizeMismatchError, match=r"different sizes.*\[100, 101"):
            be.compressed_allreduce(buf, we, se, 0)
        assert (buf == 1).all() and not we.any() and not se.any()

    check_all(run, world)
