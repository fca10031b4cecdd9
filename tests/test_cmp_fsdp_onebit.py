"""compressed.fsdp's 1-bit gradient reduce-scatter (bits=1, error feedback) against a float64
simulation of the 1-bit engine's reduce-scatter phase over several steps: uneven shards (rows
not a multiple of 8), bf16 and fp32, SUM/AVG/PREMUL_SUM, on mpicomm and gloo groups; FSDP2's
gradients with quantize_comms(grad_bits=1); the error state through ckpt."""
from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist

import mpicomm  # noqa: F401 - registers the backend
from compressed.fsdp import QuantizedReduceScatter
from mpitest import assert_all, assert_close_all

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.fixture(scope="module")
def groups(world):
    dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")
    yield {"mpicomm": dist.group.WORLD, "gloo": gloo}
    dist.destroy_process_group()


def simulate_step(rows: list[np.ndarray], errors: list[np.ndarray]) -> list[np.ndarray]:
    """One 1-bit reduce-scatter in float64: ``rows[i]`` (world, m) is rank i's input, ``errors[i]``
    (world * m8) its worker error, updated; returns each rank's mean estimate of its row."""
    world, m = rows[0].shape
    m8 = -(-m // 8) * 8
    signs, scales = [], []
    for i in range(world):
        g = np.zeros((world, m8))
        g[:, :m] = rows[i]
        x = g.reshape(-1) + errors[i]
        s = float(np.float32(np.sqrt(np.sum(x * x) / x.size)))
        sign = np.where(x >= 0, 1.0, -1.0)
        errors[i] = x - s * sign
        signs.append(sign.reshape(world, m8)[:, :m])
        scales.append(s)
    return [sum(scales[i] * signs[i][j] for i in range(world)) / world for j in range(world)]


def _input(step: int, rank: int, world: int, m: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    scale = torch.logspace(-2, 1, m)  # magnitudes that differ along the row
    return (torch.randn(world, m, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("backend,dtype,opname,m", [
    ("mpicomm", torch.float32, "avg", 13), ("mpicomm", torch.bfloat16, "sum", 16),
    ("gloo", torch.float32, "premul", 21), ("gloo", torch.bfloat16, "avg", 5)])
def test_onebit_reduce_scatter_matches_simulation(groups, world, backend, dtype, opname, m):
    group, rank, size = groups[backend], world.rank, world.size
    comm = QuantizedReduceScatter(bits=1)
    op, mult = {"sum": (dist.ReduceOp.SUM, size), "avg": (dist.ReduceOp.AVG, 1.0),
                "premul": (dist.ReduceOp.PREMUL_SUM(0.25), 0.25 * size)}[opname]
    m8 = -(-m // 8) * 8
    errors = [np.zeros(size * m8) for _ in range(size)]
    for step in range(3):
        inputs = [_input(step, r, size, m, dtype) for r in range(size)]
        out = torch.empty(m, dtype=dtype)
        work = comm(out, inputs[rank].reshape(-1).clone(), group, op,
                    async_op=opname == "avg")
        if work is not None:
            work.wait()
            assert_all(work.is_completed(), "work not completed after wait()")
        if size == 1:  # nothing travels: the gradient passes exactly
            expected = (inputs[0][0].double() * mult).to(dtype).double().numpy()
            assert_all(bool(np.array_equal(out.double().numpy(), expected)), "not exact at 1 rank")
            continue
        means = simulate_step([t.double().numpy() for t in inputs], errors)
        expected = torch.from_numpy(means[rank] * mult).to(dtype).double().numpy()
        rtol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
        assert_close_all(out.double(), expected, rtol=rtol, atol=1e-6 * float(np.abs(expected).max()),
                         what=f"step {step} output ({backend} {dtype} {opname})")
        got_e = comm.state_dict()["worker_error"].double().numpy()
        assert_close_all(got_e, errors[rank], rtol=1e-4, atol=1e-5 * float(np.abs(errors[rank]).max()),
                         what=f"step {step} worker error")
