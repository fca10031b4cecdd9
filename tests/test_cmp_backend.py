"""MpiBackend.compressed_allreduce against an independent float64 simulation built on plain allreduce.

The simulation follows the algorithm's text: x = padded input + worker error, one worker scale
||x|| / sqrt(padded n), signs with 0 as +1, the mean of scale * sign over ranks (a plain
allreduce), each rank's chunk plus its server error compressed again, chunks gathered. A
position may differ from it only where the compensated server value is within float noise of 0.
Groups of 1, 2, 3 and 4 ranks are carved out of the world (those larger than it are skipped).
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from mpi4py import MPI

import compressed
import mpicomm
from mpitest import assert_all, check_all

_GROUPS: dict[int, tuple] = {}


def group(world: MPI.Comm, q: int):
    """(mpi4py comm or None, mpicomm Communicator or None) for ranks 0..q-1 of the world."""
    if q not in _GROUPS:
        sub = world.Split(0 if world.rank < q else MPI.UNDEFINED, world.rank)
        _GROUPS[q] = (sub, mpicomm.Communicator(sub)) if sub != MPI.COMM_NULL else (None, None)
    return _GROUPS[q]


def sign(x: np.ndarray) -> np.ndarray:
    return np.where(x >= 0, 1.0, -1.0)


def simulate(g, we, se, sub: MPI.Comm) -> dict:
    """One compressed allreduce in float64 numpy from the algorithm text (g unpadded, flat)."""
    p, r = sub.size, sub.rank
    g = np.asarray(g, np.float64).reshape(-1)
    we = np.asarray(we, np.float64)
    se = np.asarray(se, np.float64)
    N = we.size
    x = np.zeros(N)
    x[: g.size] = g
    x += we
    scale = np.linalg.norm(x) / np.sqrt(N)
    compressed_x = scale * sign(x)
    mean = np.empty(N)
    sub.Allreduce(compressed_x / p, mean, op=MPI.SUM)
    chunk = N // p
    s = mean[r * chunk:(r + 1) * chunk] + se
    sscale = np.linalg.norm(s) / np.sqrt(chunk)
    out_full = np.empty(N)
    sub.Allgather(sscale * sign(s), out_full)
    s_full = np.empty(N)
    sub.Allgather(s, s_full)
    return {"out": out_full[: g.size], "we": x - compressed_x, "se": s - sscale * sign(s),
            "s_full": s_full, "s": s, "scale": scale, "sscale": sscale}


def to_np(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().float().numpy().astype(np.float64).reshape(-1)
    return np.asarray(t, np.float64).reshape(-1)


def compare(out, we, se, ref: dict, *, out_rtol: float = 2e-6) -> None:
    """Assert the implementation's result and new errors match the simulation (see module doc)."""
    out, we, se = to_np(out), to_np(we), to_np(se)
    n = out.size
    noise = 1e-5 * (np.abs(ref["s_full"]).max() + 1e-30)
    near0_full = np.abs(ref["s_full"]) <= noise
    near0 = near0_full[:n]
    assert near0.sum() <= max(1, n // 100), f"{near0.sum()} of {n} server values near 0: bad test data"
    bad = (np.abs(out - ref["out"]) > out_rtol * np.abs(ref["out"]) + 1e-30) & ~near0
    assert not bad.any(), (f"output differs at {np.flatnonzero(bad)[:10]} (of {n}): "
                           f"{out[bad][:5]} vs {ref['out'][bad][:5]}")
    wscale = max(ref["scale"], 1e-30)
    np.testing.assert_allclose(we, ref["we"], rtol=0, atol=4e-6 * wscale, err_msg="worker_error")
    chunk = se.size
    mine = near0_full.reshape(-1, chunk)[int(np.argmax([np.array_equal(c, ref["s"]) for c in
                                                       ref["s_full"].reshape(-1, chunk)]))]
    sok = ~mine
    tol = 4e-6 * (np.abs(ref["s"]).max() + ref["sscale"] + 1e-30)
    np.testing.assert_allclose(se[sok], ref["se"][sok], rtol=0, atol=tol, err_msg="server_error")


def backend_for(kernels: str, comm):
    return compressed.MpiBackend(comm=comm, kernels=kernels)


# Decided without selecting anything: collection changes no global kernel state.
KERNELS = ["numpy", "torch"] + (["numba"] if importlib.util.find_spec("numba") else [])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("q", [1, 2, 3, 4])
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 41), (1000,), (64, 33)])
def test_matches_simulation_over_consecutive_calls(world, q, kernels, shape):
    if world.size < q:
        pytest.skip(f"needs {q} ranks")
    sub, comm = group(world, q)
    if sub is None:
        assert_all(True)
        return

    def run():
        backend = backend_for(kernels, comm)
        n = int(np.prod(shape))
        N = compressed.padded_size(n, q)
        we = torch.zeros(N)
        se = torch.zeros(N // q)
        rng = np.random.default_rng(1000 * sub.rank + n)
        for step in range(3):
            g = torch.from_numpy((rng.standard_normal(shape) + 0.1 * sub.rank).astype(np.float32))
            ref = simulate(g.numpy(), we.numpy().copy(), se.numpy().copy(), sub)
            buf = g.clone()
            out = backend.compressed_allreduce(buf, we, se, 0)
            assert out is buf and out.shape == g.shape and out.dtype == torch.float32
            compare(out, we, se, ref)
        assert backend.calls == 3

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_buffers(world, comm, dtype):
    def run():
        backend = compressed.MpiBackend(comm=comm)
        n, p = 300, comm.size
        rng = np.random.default_rng(comm.rank)
        g = rng.standard_normal((10, 30)).astype(dtype)
        we = (rng.standard_normal(compressed.padded_size(n, p)) * 0.1).astype(np.float32)
        se = (rng.standard_normal(we.size // p) * 0.1).astype(np.float32)
        ref = simulate(g.astype(np.float32), we.copy(), se.copy(), world)
        buf = g.copy()
        out = backend.compressed_allreduce(buf, we, se, 0)
        assert out is buf and out.dtype == dtype and out.shape == (10, 30)
        compare(out, we, se, ref)

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kernels", ["host", "torch"])
def test_half_inputs_computed_in_fp32(world, comm, dtype, kernels):
    def run():
        backend = compressed.MpiBackend(comm=comm, kernels=kernels)
        n, p = 500, comm.size
        torch.manual_seed(comm.rank)
        g = torch.randn(n).to(dtype)
        we = torch.zeros(compressed.padded_size(n, p))
        se = torch.zeros(we.numel() // p)
        ref = simulate(g.float().numpy(), we.numpy().copy(), se.numpy().copy(), world)
        buf = g.clone()
        out = backend.compressed_allreduce(buf, we, se, 0)
        assert out.dtype == dtype
        compare(out, we, se, ref, out_rtol=1e-2)

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kernels", ["host", "torch"])
def test_zero_input_gives_zero(world, comm, kernels):
    def run():
        backend = compressed.MpiBackend(comm=comm, kernels=kernels)
        n = 77
        buf = torch.zeros(n)
        we = torch.zeros(compressed.padded_size(n, comm.size))
        se = torch.zeros(we.numel() // comm.size)
        for _ in range(2):
            out = backend.compressed_allreduce(buf, we, se, 0)
            assert torch.equal(out, torch.zeros(n)) and not out.isnan().any()
            assert torch.count_nonzero(we) == 0 and torch.count_nonzero(se) == 0

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
def test_empty_is_noop(world, comm):
    def run():
        backend = compressed.MpiBackend(comm=comm)
        buf = torch.zeros(0)
        out = backend.compressed_allreduce(buf, torch.zeros(0), torch.zeros(0), 0)
        assert out is buf and backend.calls == 0

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("kernels", ["host", "torch"])
def test_non_finite_raises_everywhere_and_modifies_nothing(world, comm, bad, kernels):
    def run():
        backend = compressed.MpiBackend(comm=comm, kernels=kernels)
        n, p = 100, comm.size
        torch.manual_seed(comm.rank)
        buf = torch.randn(n)
        if comm.rank == comm.size - 1:
            buf[17] = bad
        we = torch.randn(compressed.padded_size(n, p)) * 0.1
        se = torch.randn(we.numel() // p) * 0.1
        copies = [t.clone() for t in (buf, we, se)]
        with pytest.raises(compressed.NonFiniteError, match=rf"rank\(s\) \[{comm.size - 1}\]"):
            backend.compressed_allreduce(buf, we, se, 0)
        for now, before in zip((buf, we, se), copies):
            assert torch.equal(now, before) or (now.isnan() == before.isnan()).all() and \
                torch.equal(now.nan_to_num(0), before.nan_to_num(0))
        assert backend.calls == 0

    check_all(run, world)


def test_argument_errors_name_expectations():
    backend = compressed.MpiBackend(comm=MPI.COMM_SELF)
    buf = torch.zeros(10)
    with pytest.raises(ValueError, match=r"worker_error must have padded_size\(10, 1\) = 16 elements"):
        backend.compressed_allreduce(buf, torch.zeros(10), torch.zeros(16), 0)
    with pytest.raises(ValueError, match="server_error must have"):
        backend.compressed_allreduce(buf, torch.zeros(16), torch.zeros(8), 0)
    with pytest.raises(TypeError, match="contiguous float32"):
        backend.compressed_allreduce(buf, torch.zeros(16, dtype=torch.float64), torch.zeros(16), 0)
    with pytest.raises(TypeError, match="floating dtype"):
        backend.compressed_allreduce(torch.zeros(10, dtype=torch.int32), torch.zeros(16),
                                     torch.zeros(16), 0)
    with pytest.raises(TypeError, match="same kind of buffer"):
        backend.compressed_allreduce(buf, np.zeros(16, np.float32), torch.zeros(16), 0)
    with pytest.raises(TypeError, match="comm: expected"):
        compressed.MpiBackend(comm="world")


@pytest.mark.mpi(min_size=1)
def test_error_feedback_running_average_converges(world, comm):
    """Repeating one input, the running average of the outputs approaches the true mean."""
    def run():
        backend = compressed.MpiBackend(comm=comm)
        n, p = 2000, comm.size
        rng = np.random.default_rng(7 + comm.rank)
        g = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * (1 + comm.rank))
        true = g.double().numpy().copy()
        world.Allreduce(MPI.IN_PLACE, true, op=MPI.SUM)
        true /= p
        we = torch.zeros(compressed.padded_size(n, p))
        se = torch.zeros(we.numel() // p)
        total = np.zeros(n)
        errs = {}
        for t in range(1, 201):
            total += backend.compressed_allreduce(g.clone(), we, se, 0).double().numpy()
            if t in (1, 10, 200):
                errs[t] = np.linalg.norm(total / t - true) / np.linalg.norm(true)
        assert errs[200] < 0.05 and errs[200] < errs[10] / 5 < errs[1], errs

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_non_contiguous_input(world, comm, kind):
    def run():
        backend = compressed.MpiBackend(comm=comm)
        rng = np.random.default_rng(comm.rank + 50)
        base = rng.standard_normal((12, 9)).astype(np.float32)
        g = torch.from_numpy(base.copy()).t() if kind == "torch" else base.copy().T
        assert not (g.is_contiguous() if kind == "torch" else g.flags.c_contiguous)
        n, p = 108, comm.size
        we = np.zeros(compressed.padded_size(n, p), np.float32)
        se = np.zeros(we.size // p, np.float32)
        if kind == "torch":
            we, se = torch.from_numpy(we), torch.from_numpy(se)
        flat = np.ascontiguousarray(base.T).reshape(-1)  # row-major order of the transposed view
        ref = simulate(flat, np.zeros(we.shape[0]), np.zeros(se.shape[0]), world)
        out = backend.compressed_allreduce(g, we, se, 0)
        assert out is g and tuple(out.shape) == (9, 12)
        compare(np.ascontiguousarray(np.asarray(out)).reshape(-1), we, se, ref)

    check_all(run, world)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("cuda_aware", [False, True])
def test_cuda_tensors(world, comm, cuda_aware):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def run():
        dev = torch.device("cuda", comm.local_rank % torch.cuda.device_count())
        backend = compressed.MpiBackend(cuda_aware=cuda_aware, comm=comm)
        n, p = 5000, comm.size
        g = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank))
        we = torch.zeros(compressed.padded_size(n, p), device=dev)
        se = torch.zeros(we.numel() // p, device=dev)
        ref = simulate(g.numpy(), np.zeros(we.numel()), np.zeros(se.numel()), world)
        buf = g.to(dev)
        out = backend.compressed_allreduce(buf, we, se, comm.local_rank)
        assert out is buf and out.device == dev
        compare(out.cpu(), we.cpu(), se.cpu(), ref)

    check_all(run, world)
