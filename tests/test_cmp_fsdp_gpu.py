"""compressed.fsdp on CUDA tensors (fp32 and bf16) against the float64 simulations of the CPU
tests: the int8 kernels, QuantizedAllGather(bits=8), QuantizedReduceScatter(bits=8 and 1) and
quantize_comms on a small fully_shard model, over the mpicomm process group (1 and 2 ranks; two
ranks may share one GPU, mpicomm stages through the host when MPI is not CUDA-aware) and over
NCCL (one GPU per rank). Every result and every wire tensor must stay on the GPU.

Skipped without CUDA. Run on a GPU machine with ./scripts/gpu_check.sh (1 and 2 ranks).
"""
from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

import mpicomm  # noqa: F401 - registers the backend
from compressed.fsdp import QuantizedAllGather, QuantizedReduceScatter, collectives
from compressed.fsdp.install import param_groups
from compressed.fsdp.quantize import dequantize_into, layout, quantize_rows, reduce_rows
from mpitest import assert_all, assert_close_all, check_all
from test_cmp_fsdp import BLOCK, _shard, _sim, check_gathered
from test_cmp_fsdp import check_grads as check_grads_q8
from test_cmp_fsdp_onebit import _input, simulate_step
from test_cmp_fsdp_onebit import check_grads as check_grads_q1
from test_cmp_fsdp_quant import _compare

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)"),
              pytest.mark.skipif(not hasattr(FSDPModule, "set_custom_all_gather"),
                                 reason=f"torch {torch.__version__} has no FSDP2 custom "
                                        "collectives (FSDPModule.set_custom_all_gather)")]

WORLD = MPI.COMM_WORLD


def _nccl_skip_reason() -> str | None:
    """Why NCCL cannot run here, the same answer on every rank (None: it can)."""
    if not dist.is_nccl_available():
        return "torch built without NCCL"
    if torch.cuda.device_count() < WORLD.size:
        return (f"NCCL refuses two ranks on one GPU: {WORLD.size} ranks, "
                f"{torch.cuda.device_count()} GPU(s)")
    return None


@pytest.fixture(scope="module")
def groups(device):
    """``{"mpicomm": group, "nccl": group or None}`` over the MPI world."""
    owner = not dist.is_initialized()
    if owner:
        dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=120))
        mine = dist.group.WORLD
    else:
        mine = dist.new_group(backend="mpicomm")
    nccl = dist.new_group(backend="nccl") if _nccl_skip_reason() is None else None
    yield {"mpicomm": mine, "nccl": nccl}
    if owner:
        dist.destroy_process_group()


@pytest.fixture(params=["mpicomm", "nccl"])
def backend(request, groups):
    if request.param == "nccl" and groups["nccl"] is None:
        pytest.skip(_nccl_skip_reason())
    return request.param


@pytest.fixture
def wire_devices(monkeypatch) -> list:
    """The devices of every ``quantize_rows`` input and packed wire tensor the collectives make
    (the CUDA path; the CPU one packs in its numba kernels instead)."""
    seen = []
    real = collectives.quantize_rows

    def spy(x, lay, out=None):
        packed = real(x, lay, out)
        seen.append((x.device, packed.device))
        return packed
    monkeypatch.setattr(collectives, "quantize_rows", spy)
    return seen


def _on_device(seen: list, device: torch.device, size: int) -> None:
    """Collective: at more than one rank the collectives quantized on ``device`` only."""
    ok = all(d == device and p == device for d, p in seen) and (size == 1 or bool(seen))
    assert_all(ok, f"quantized on {seen or 'nothing'}, expected {device}")


def _premul(factor: float):
    """FSDP2's PREMUL_SUM op, as torch makes it for NCCL (``ReduceOp.factor`` since 2.13)."""
    return dist._make_nccl_premul_sum(factor)


# ---------------------------------------------------------------------------------------------
# the kernels (no communication)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_on_the_device(device, dtype):
    segments = (20, 10, 7)  # blocks of 8 with a short tail in every segment
    n = sum(segments)
    lay = layout(n, BLOCK, segments)
    x = torch.stack([_shard(r, n, dtype, segments) for r in range(3)])

    def run():
        packed = quantize_rows(x.to(device), lay)
        assert packed.device == device and packed.dtype == torch.uint8, packed.device
        out = torch.empty(x.shape, dtype=torch.float32, device=device)
        dequantize_into(packed, lay, out)
        _compare(out.cpu(), x.float(), BLOCK, list(segments))
        own = x[1].to(device)
        total = reduce_rows(packed, lay, own, 1, 0.5)
        assert total.device == device, total.device
        rows = [_sim(x[r].double().numpy(), segments, torch.float32) for r in (0, 2)]
        want = 0.5 * (rows[0] + x[1].double().numpy() + rows[1])
        np.testing.assert_allclose(total.double().cpu().numpy(), want, rtol=1e-6,
                                   atol=1e-6 * np.abs(want).max())
    check_all(run)


# ---------------------------------------------------------------------------------------------
# the collectives as FSDP2 calls them

@pytest.mark.parametrize("dtype,async_op", [(torch.float32, False), (torch.bfloat16, True)])
def test_all_gather_on_cuda(groups, backend, device, wire_devices, dtype, async_op):
    group, rank, size = groups[backend], WORLD.rank, WORLD.size
    segments = (20, 10, 7)
    n = sum(segments)
    comm = QuantizedAllGather(bits=8, block=BLOCK, segments=segments)
    out = comm.allocate((size * n,), dtype=dtype, device=device)
    inp = out.narrow(0, rank * n, n)  # FSDP2 gathers in place: the input is this rank's slice
    inp.copy_(_shard(rank, n, dtype, segments))
    work = comm(out, inp, group, async_op=async_op)
    if async_op:
        assert_all(isinstance(work, dist.Work), repr(work))
        work.wait()
    assert_all(out.device == device, f"output on {out.device}")
    _on_device(wire_devices, device, size)
    rows = [_shard(r, n, dtype, segments).double().numpy() for r in range(size)]
    expected = np.concatenate([rows[r] if r == rank else _sim(rows[r], segments, dtype)
                               for r in range(size)])
    assert_close_all(out.double().cpu(), expected, what=f"all-gather {backend} {dtype}")


@pytest.mark.parametrize("dtype,opname", [(torch.float32, "sum"), (torch.bfloat16, "avg"),
                                          (torch.float32, "premul")])
def test_reduce_scatter_on_cuda(groups, backend, device, wire_devices, dtype, opname):
    group, rank, size = groups[backend], WORLD.rank, WORLD.size
    segments = (13, 4)
    m = sum(segments)
    comm = QuantizedReduceScatter(bits=8, block=BLOCK, segments=segments)

    def chunks(r):  # rank r's input: one row per destination
        return torch.stack([_shard(10 * r + j, m, dtype, segments) for j in range(size)])
    inp = comm.allocate((size * m,), dtype=dtype, device=device)
    inp.copy_(chunks(rank).reshape(-1))
    out = comm.allocate((m,), dtype=dtype, device=device)
    op, factor = {"sum": (dist.ReduceOp.SUM, 1.0), "avg": (dist.ReduceOp.AVG, 1.0 / size),
                  "premul": (_premul(0.25), 0.25)}[opname]
    if opname == "premul" and not hasattr(op, "factor"):  # torch < 2.13: a clear refusal
        def refused():
            with pytest.raises(ValueError, match="PREMUL_SUM's factor|expected reduce op SUM"):
                comm(out, inp, group, op)
        check_all(refused)
        return
    work = comm(out, inp, group, op, async_op=opname == "avg")
    if work is not None:
        work.wait()
    assert_all(out.device == device, f"output on {out.device}")
    _on_device(wire_devices, device, size)
    total = np.zeros(m)
    for r in range(size):
        row = chunks(r)[rank].double().numpy()
        total += row if r == rank else _sim(row, segments, torch.float32)
    expected = torch.from_numpy(total * factor).float().to(dtype).double().numpy()
    if dtype == torch.float32:
        assert_close_all(out.double().cpu(), expected, atol=1e-5 * np.abs(expected).max(),
                         what=f"reduce-scatter {backend} {opname}")
    else:
        assert_close_all(out.double().cpu(), expected, rtol=2 ** -7,
                         what=f"reduce-scatter {backend} {opname}")


@pytest.mark.parametrize("dtype,opname,m", [(torch.float32, "avg", 13),
                                            (torch.bfloat16, "sum", 16)])
def test_onebit_reduce_scatter_on_cuda(groups, backend, device, dtype, opname, m):
    group, rank, size = groups[backend], WORLD.rank, WORLD.size
    comm = QuantizedReduceScatter(bits=1)
    op, mult = {"sum": (dist.ReduceOp.SUM, size), "avg": (dist.ReduceOp.AVG, 1.0)}[opname]
    errors = [np.zeros(size * (-(-m // 8) * 8)) for _ in range(size)]
    for step in range(3):
        inputs = [_input(step, r, size, m, dtype) for r in range(size)]
        out = torch.empty(m, dtype=dtype, device=device)
        work = comm(out, inputs[rank].reshape(-1).to(device), group, op,
                    async_op=opname == "sum")
        if work is not None:
            work.wait()
        assert_all(out.device == device, f"output on {out.device}")
        if size == 1:  # nothing travels: the gradient passes exactly
            expected = (inputs[0][0].double() * mult).to(dtype).double().numpy()
            assert_close_all(out.double().cpu(), expected, what="1 rank")
            continue
        e = comm.state_dict()["worker_error"]
        assert_all(e.device == device, f"worker error on {e.device}")
        means = simulate_step([t.double().numpy() for t in inputs], errors)
        expected = torch.from_numpy(means[rank] * mult).to(dtype).double().numpy()
        rtol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
        assert_close_all(out.double().cpu(), expected, rtol=rtol,
                         atol=1e-6 * float(np.abs(expected).max()),
                         what=f"step {step} output ({backend} {dtype} {opname})")
        assert_close_all(e.double().cpu(), errors[rank], rtol=1e-4,
                         atol=1e-5 * float(np.abs(errors[rank]).max()),
                         what=f"step {step} worker error")


# ---------------------------------------------------------------------------------------------
# quantize_comms on fully_shard models

def _mesh(groups, backend) -> DeviceMesh:
    return DeviceMesh.from_group(groups[backend], "cuda")


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_fsdp_gathered_weights_on_cuda(groups, backend, device, wire_devices, param_dtype):
    check_gathered(WORLD, _mesh(groups, backend), param_dtype, device)
    _on_device(wire_devices, device, WORLD.size)


def test_fsdp_int8_gradients_on_cuda(groups, backend, device, wire_devices):
    check_grads_q8(WORLD, _mesh(groups, backend), 1, True, device)
    _on_device(wire_devices, device, WORLD.size)


def test_fsdp_onebit_gradients_on_cuda(groups, backend, device):
    model = check_grads_q1(WORLD, _mesh(groups, backend), 1, steps=2, device=device)
    states = [param_groups(m)[0]._reduce_scatter_comm.onebit for m in (model[0], model[2])]
    where = [None if s.worker_error is None else s.worker_error.device for s in states]
    assert_all(WORLD.size == 1 or all(w == device for w in where),
               f"worker errors on {where}, expected {device}")
