"""Hierarchical 1-bit allreduce against a float64 simulation of its documented semantics.

Nodes are simulated on one machine with MPICOMM_NODE_SIZE (test/simulation override). The
reference: the float64 mean over the node's ranks (plain allreduce on a node communicator built
here), this rank's part of it (local index j of L), then the flat algorithm's float64 simulation
(``test_cmp_backend.simulate``) among the ranks of local index j, one per node, and the parts
gathered inside the node.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from mpi4py import MPI

import compressed
from compressed.hierarchical import NODE_SIZE_ENV, decide
from mpitest import check_all
from test_cmp_backend import group, simulate


def test_decide_default_and_refusals():
    assert decide([2, 2], None) and decide([3, 3, 3], True)
    assert not decide([2, 2], False)
    for counts in ([4], [1, 1], [2, 1], [1, 1, 1]):
        assert not decide(counts, None)
        with pytest.raises(ValueError, match=r"hierarchical=True needs several nodes .* "
                                             r"flat algorithm"):
            decide(counts, True)


def _reference(g: np.ndarray, we: np.ndarray, se: np.ndarray, world4: MPI.Comm, L: int) -> dict:
    """Float64 result of one hierarchical call on the 4-rank group (nodes of L ranks)."""
    r = world4.rank
    node = world4.Split(r // L, r)
    cross = world4.Split(r % L, r)
    try:
        p = world4.size
        padded = compressed.padded_size(g.size, p)
        sub = padded // L
        x = np.zeros(padded)
        x[:g.size] = g
        mean = np.empty(padded)
        node.Allreduce(x / L, mean, op=MPI.SUM)
        j = node.rank
        ref = simulate(mean[j * sub:(j + 1) * sub], we[:sub], se, cross)
        out = np.empty(padded)
        node.Allgather(np.ascontiguousarray(ref["out"]), out)
        s_full = np.empty(padded)
        node.Allgather(np.ascontiguousarray(ref["s_full"]), s_full)
        ref.update(out_full=out[:g.size], near0=np.abs(s_full[:g.size]) <= 1e-5 * (np.abs(s_full).max() + 1e-30),
                   sub=sub)
        return ref
    finally:
        node.Free()
        cross.Free()


def _check(out, we, se, ref) -> None:
    out, we, se = (np.asarray(t, np.float64).reshape(-1) for t in (out, we, se))
    sub = ref["sub"]
    near0 = ref["near0"]
    assert near0.sum() <= max(1, out.size // 100), "bad test data: many server values near 0"
    bad = (np.abs(out - ref["out_full"]) > 2e-6 * np.abs(ref["out_full"]) + 1e-30) & ~near0
    assert not bad.any(), f"output differs at {np.flatnonzero(bad)[:10]}"
    np.testing.assert_allclose(we[:sub], ref["we"], rtol=0, atol=4e-6 * max(ref["scale"], 1e-30),
                               err_msg="worker error (this rank's part)")
    assert not we[sub:].any(), "the unused part of the worker error changed"
    tol = 4e-6 * (np.abs(ref["s"]).max() + ref["sscale"] + 1e-30)
    mine = np.abs(ref["s"]) > 1e-5 * (np.abs(ref["s_full"]).max() + 1e-30)
    np.testing.assert_allclose(se[mine], ref["se"][mine], rtol=0, atol=tol, err_msg="server error")


def _group4(world):
    if world.size < 4:
        pytest.skip("needs 4 ranks (2 simulated nodes x 2)")
    return group(world, 4)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("api", ["backend", "onebit"])
@pytest.mark.parametrize("n,pieces,kernels", [(5, False, None), (96, False, None), (1000, False, None),
                                              (1003, True, None), (200, False, "torch"),
                                              (200, False, "numpy")])
def test_hierarchical_matches_float64_simulation(world, monkeypatch, api, n, pieces, kernels):
    sub4, comm4 = _group4(world)
    monkeypatch.setenv(NODE_SIZE_ENV, "2")
    if pieces:  # the cross-node part in many small pieces, with MPI progress between steps
        from compressed import wire_format

        monkeypatch.setattr(wire_format, "PIECE_BYTES", 8)
        monkeypatch.setattr(wire_format, "MAX_PIECES", 1000)
        monkeypatch.setattr(compressed.compressor, "_one_node", lambda comm: False)
        monkeypatch.setattr(compressed.engine, "STEP_BYTES", 8)

    def run():
        if sub4 is None:
            return
        p = comm4.size
        N = compressed.padded_size(n, p)
        if api == "backend":
            b = compressed.MpiBackend(comm=comm4, kernels=kernels)
            assert b.hierarchical and b.hierarchy.describe() == "hierarchical: 2 nodes x 2 ranks"
        else:
            ar = compressed.OnebitAllreduce(comm4, kernels=kernels)
            assert ar.compressor.hierarchical
        we, se = torch.zeros(N), torch.zeros(N // p)
        rng = np.random.default_rng(100 + comm4.rank)
        for _ in range(3):  # error feedback carried over consecutive calls
            g = rng.standard_normal(n).astype(np.float32)
            ref = _reference(g.astype(np.float64), we.numpy().astype(np.float64),
                             se.numpy().astype(np.float64), sub4, 2)
            if api == "backend":
                out = b.compressed_allreduce(torch.from_numpy(g.copy()), we, se, 0)
            else:
                out = ar(torch.from_numpy(g), key="k")
                we, se = ar.errors("k")
            _check(out.numpy(), we.numpy(), se.numpy(), ref)
            # every rank decodes the same gathered bytes: bit-identical results everywhere
            outs = sub4.allgather(out.numpy().tobytes())
            assert all(o == outs[0] for o in outs), "ranks hold different results"

    check_all(run, world)


@pytest.mark.mpi(min_size=4)
def test_hierarchical_false_is_flat(world, monkeypatch):
    sub4, comm4 = _group4(world)
    monkeypatch.setenv(NODE_SIZE_ENV, "2")

    def run():
        if sub4 is None:
            return
        b = compressed.MpiBackend(comm=comm4, hierarchical=False)
        assert not b.hierarchical
        N = compressed.padded_size(200, 4)
        g = np.random.default_rng(comm4.rank).standard_normal(200).astype(np.float32)
        ref = simulate(g, np.zeros(N), np.zeros(N // 4), sub4)
        out = b.compressed_allreduce(torch.from_numpy(g.copy()), torch.zeros(N), torch.zeros(N // 4))
        ok = np.abs(ref["s_full"][:200]) > 1e-5 * np.abs(ref["s_full"]).max()
        np.testing.assert_allclose(out.numpy()[ok], ref["out"][ok], rtol=2e-6)

    check_all(run, world)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("api", ["backend", "onebit"])
def test_hierarchical_non_finite_raises_everywhere_and_changes_nothing(world, monkeypatch, api):
    sub4, comm4 = _group4(world)
    monkeypatch.setenv(NODE_SIZE_ENV, "2")

    def run():
        if sub4 is None:
            return
        N = compressed.padded_size(64, 4)
        g = torch.randn(64)
        if api == "backend":
            b = compressed.MpiBackend(comm=comm4)
            we, se = torch.zeros(N), torch.zeros(N // 4)
            b.compressed_allreduce(g.clone(), we, se)
        else:
            ar = compressed.OnebitAllreduce(comm4)
            ar(g, key="k")
            we, se = ar.errors("k")
        we0, se0 = we.clone(), se.clone()
        y = torch.randn(64)
        if comm4.rank == 3:
            y[7] = float("nan")  # node 1's part 0: only the ranks of local index 0 see it
        y0 = y.clone()
        with pytest.raises(compressed.NonFiniteError, match="not finite"):
            if api == "backend":
                b.compressed_allreduce(y, we, se)
            else:
                ar(y, key="k")
        if api == "onebit":
            we, se = ar.errors("k")
        assert torch.equal(we, we0) and torch.equal(se, se0)
        assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(y0)), "the input was modified"

    check_all(run, world)


@pytest.mark.mpi(min_size=4)
def test_hierarchical_size_mismatch_inside_a_node_raises_everywhere(world, monkeypatch):
    sub4, comm4 = _group4(world)
    monkeypatch.setenv(NODE_SIZE_ENV, "2")

    def run():
        if sub4 is None:
            return
        b = compressed.MpiBackend(comm=comm4)
        n = 72 if comm4.rank == 1 else 64
        N = compressed.padded_size(n, 4)
        with pytest.raises(compressed.SizeMismatchError, match="different sizes"):
            b.compressed_allreduce(torch.randn(n), torch.zeros(N), torch.zeros(N // 4))

    check_all(run, world)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("node_size", ["1", "2", ""])
def test_hierarchical_true_refused_where_it_cannot_run(world, monkeypatch, node_size):
    # 2 ranks: one node of 2 ("2" or MPI's own answer on this machine) or 2 nodes of 1 ("1");
    # 3 ranks with nodes of 2 are uneven
    q = 3 if world.size >= 3 and node_size == "2" else 2
    sub, comm = group(world, q)
    if node_size:
        monkeypatch.setenv(NODE_SIZE_ENV, node_size)

    def run():
        if sub is None:
            return
        with pytest.raises(ValueError, match="hierarchical=True needs several nodes"):
            compressed.OnebitAllreduce(comm, hierarchical=True)
        fallback = compressed.OnebitAllreduce(comm)  # None: the flat algorithm
        assert not fallback.compressor.hierarchical
        x = torch.ones(48) * (comm.rank + 1)  # 48: no padding, so the mean is exact
        out = fallback(x, key="k")
        assert torch.allclose(out, torch.full((48,), (comm.size + 1) / 2))

    check_all(run, world)


@pytest.mark.mpi(min_size=4)
def test_ddp_state_passes_hierarchical(world, monkeypatch):
    sub4, comm4 = _group4(world)
    monkeypatch.setenv(NODE_SIZE_ENV, "2")

    def run():
        if sub4 is None:
            return
        assert compressed.OnebitDDPState(comm4).allreduce.compressor.hierarchical
        flat = compressed.OnebitDDPState(comm4, hierarchical=False)
        assert not flat.allreduce.compressor.hierarchical

    check_all(run, world)


@pytest.mark.mpi(min_size=4)
def test_layout_record_names_the_part_and_chunk_each_rank_serves(world, monkeypatch):
    """The record a checkpoint keeps (compressed.reshard) is the communicators' own numbering:
    part = rank in the node's communicator, chunk = rank in the cross-node communicator; a state
    saved under it loads back exactly, and a flat state is refused by load_state_dict."""
    sub4, comm4 = _group4(world)
    monkeypatch.setenv(NODE_SIZE_ENV, "2")

    def run():
        if sub4 is None:
            return
        ar = compressed.OnebitAllreduce(comm4)
        h = ar.compressor.hierarchy
        nodes, per_node, positions = h.layout_record()
        assert (nodes, per_node) == (2, 2) and positions[comm4.rank] == (h.cross.rank, h.node.rank)
        ar(torch.from_numpy(np.random.default_rng(comm4.rank).standard_normal(300).astype(np.float32)))
        state = ar.state_dict()
        assert state["hierarchy"] == [2, 2, h.cross.rank, h.node.rank]
        ar.load_state_dict(copy.deepcopy(state))
        again = ar.state_dict()
        assert torch.equal(again["errors"]["default"]["worker_error"], state["errors"]["default"]["worker_error"])
        flat = copy.deepcopy(state)
        del flat["hierarchy"]
        with pytest.raises(ValueError, match="load_per_rank_state_dict"):
            ar.load_state_dict(flat)

    check_all(run, world)
