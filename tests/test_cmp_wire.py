"""The wire: one format for every kernel family, bytes counted through the communicator, mpicomm only.

Ranks forced onto different kernel families (numba, numpy, torch) must interoperate and match
the float64 plain-allreduce simulation. Wire bytes are counted from the buffers handed to the
communicator's collectives (never recomputed from the layout's formula).
"""
from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest
import torch

import compressed
import mpicomm
from mpitest import check_all
from test_cmp_backend import compare, simulate

FAMILIES = [k for k in ("numba", "numpy", "torch") if k != "numba" or importlib.util.find_spec("numba")]


class CountingCommunicator(mpicomm.Communicator):
    """A Communicator that counts the bytes each collective hands to MPI for other ranks."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent = 0
        self.calls: list[str] = []

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          async_op=False):
        assert output_split_sizes is None and input_split_sizes is None
        rows = input.reshape(self.size, -1)
        self.sent += sum(int(rows[j].numel() * rows.element_size()) for j in range(self.size)
                         if j != self.rank)
        self.calls.append("all_to_all_single")
        return super().all_to_all_single(output, input, async_op=async_op)

    def all_gather_into_tensor(self, output_tensor, input_tensor, async_op=False):
        self.sent += (self.size - 1) * input_tensor.numel() * input_tensor.element_size()
        self.calls.append("all_gather_into_tensor")
        return super().all_gather_into_tensor(output_tensor, input_tensor, async_op=async_op)

    def all_reduce(self, tensor, op=mpicomm.ReduceOp.SUM, async_op=False):
        # bandwidth-optimal (ring) allreduce: each rank sends 2 (p - 1) / p of the buffer
        self.sent += 2 * (self.size - 1) * tensor.numel() * tensor.element_size() // self.size
        self.calls.append("all_reduce")
        return super().all_reduce(tensor, op=op, async_op=async_op)


def test_no_mpi4py_in_compressed():
    root = pathlib.Path(compressed.__file__).parent
    users = [p.name for p in root.glob("*.py") if "mpi4py" in p.read_text()]
    assert users == [], f"compressed/ must reach MPI through mpicomm only; mpi4py in {users}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shift", [0, 1, 2])
def test_ranks_on_different_kernel_families_interoperate(world, comm, shift, monkeypatch):
    """Rank r runs family (r + shift) mod 3, with pieces small enough for several messages."""
    from compressed import wire_format as layout

    monkeypatch.setattr(layout, "PIECE_BYTES", 16)
    monkeypatch.setattr(layout, "MAX_PIECES", 1000)
    monkeypatch.setattr(compressed.compressor, "_one_node", lambda comm: False)  # pieces on 1 node
    monkeypatch.setattr(compressed.engine, "STEP_BYTES", 8)  # many progress steps per piece

    def run():
        kernels = FAMILIES[(comm.rank + shift) % len(FAMILIES)]
        backend = compressed.MpiBackend(comm=comm, kernels=kernels)
        ar = compressed.OnebitAllreduce(comm, kernels=kernels)
        p, n = comm.size, 1000
        N = compressed.padded_size(n, p)
        we, se = torch.zeros(N), torch.zeros(N // p)
        state = (np.zeros(N), np.zeros(N // p))
        rng = np.random.default_rng(300 + comm.rank)
        for _ in range(3):
            g = torch.from_numpy((rng.standard_normal(n) + 0.1 * comm.rank).astype(np.float32))
            ref = simulate(g.numpy(), we.numpy().copy(), se.numpy().copy(), world)
            compare(backend.compressed_allreduce(g.clone(), we, se, 0), we, se, ref)
            ref2 = simulate(g.numpy(), *state, world)
            state = (ref2["we"], ref2["se"])
            compare(ar(g, key="k"), *ar.errors("k"), ref2)
        assert backend.family(g).name == kernels

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("n", [1000, 1 << 20])
@pytest.mark.parametrize("pieces", [False, True])
def test_wire_bytes_counted_through_the_communicator(world, n, pieces, monkeypatch):
    """One message per phase on one node; in pieces (as between nodes) the same bytes."""
    from compressed import wire_format as layout

    if pieces:
        monkeypatch.setattr(layout, "PIECE_BYTES", 1024)
        monkeypatch.setattr(compressed.compressor, "_one_node", lambda comm: False)

    def run():
        counting = CountingCommunicator(world)
        p = counting.size
        backend = compressed.MpiBackend(comm=counting)
        N = compressed.padded_size(n, p)
        g = torch.randn(n, generator=torch.Generator().manual_seed(counting.rank))
        backend.compressed_allreduce(g, torch.zeros(N), torch.zeros(N // p), 0)
        one_bit = counting.sent
        assert set(counting.calls) == {"all_to_all_single", "all_gather_into_tensor"}, counting.calls
        want_calls = 2 * min(layout.MAX_PIECES, -(-N // p // 8 // 1024)) if pieces else 2
        assert len(counting.calls) == want_calls, counting.calls
        assert backend.wire_bytes == one_bit, (backend.wire_bytes, one_bit)
        counting.sent = 0
        counting.all_reduce(torch.zeros(n))
        fp32 = counting.sent
        if p > 1:
            # 1/32 of the bits; a few bytes of scale and size per message
            assert fp32 / one_bit > (30 if n > 4096 else 20), (fp32, one_bit)
        else:
            assert one_bit == 0 and fp32 == 0

    check_all(run, world)


@pytest.mark.mpi(min_size=1)
def test_reduce_scatter_is_phase_one(world, comm):
    """compressed_reduce_scatter gives each rank its chunk of the mean of scale * sign(x)."""
    def run():
        p, n = comm.size, 999
        N = compressed.padded_size(n, p)
        backend = compressed.MpiBackend(comm=comm)
        we = torch.zeros(N)
        rng = np.random.default_rng(500 + comm.rank)
        for _ in range(2):
            g = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
            x = np.zeros(N)
            x[:n] = g.numpy()
            x += we.numpy()
            scale = np.linalg.norm(x) / np.sqrt(N)
            sx = np.where(x >= 0, scale, -scale)
            mean = sx / p
            world.Allreduce(mpi_in_place(), mean)
            out = torch.empty(N // p)
            assert backend.compressed_reduce_scatter(g, out, we) is out
            chunk = slice(comm.rank * (N // p), (comm.rank + 1) * (N // p))
            np.testing.assert_allclose(out.numpy(), mean[chunk], rtol=1e-5, atol=1e-6 * scale)
            np.testing.assert_allclose(we.numpy(), x - sx, rtol=0, atol=4e-6 * scale)

    check_all(run, world)


def mpi_in_place():
    from mpi4py import MPI

    return MPI.IN_PLACE
