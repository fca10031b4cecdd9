"""compressed.fsdp on FSDP2 (mpicomm and gloo groups) against a float64 simulation of the same
quantization: the collectives called as FSDP2 calls them (padding, uneven shards, bf16 and fp32,
SUM/AVG/PREMUL_SUM, async works), the weights FSDP2 gathers, the gradients it reduces (1-D, a
``reshard_after_forward=False`` module, HSDP on a 2x2 mesh), bad input, and a checkpoint."""
from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import mpicomm  # noqa: F401 - registers the backend
from compressed.fsdp import QuantizedAllGather, QuantizedReduceScatter, quantize_comms
from mpitest import assert_all, assert_close_all, check_all
from test_cmp_fsdp_quant import simulate

pytestmark = pytest.mark.mpi(min_size=1)
BLOCK = 8


@pytest.fixture(scope="module")
def groups(world):
    dist.init_process_group("mpicomm", timeout=datetime.timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")
    yield {"mpicomm": dist.group.WORLD, "gloo": gloo}
    dist.destroy_process_group()


def _sim(row: np.ndarray, segments, dtype) -> np.ndarray:
    """The simulated dequantized row (float64 math), rounded to ``dtype`` as the receiver does."""
    with np.errstate(invalid="ignore"):
        values = simulate(row[None, :], BLOCK, list(segments))[0]
    return torch.from_numpy(values).float().to(dtype).double().numpy()


def _shard(rank: int, n: int, dtype, segments) -> torch.Tensor:
    """Rank ``rank``'s test row: segments of very different magnitudes (seeded by rank)."""
    g = torch.Generator().manual_seed(100 + rank)
    parts = [torch.randn(s, generator=g) * (30.0 if i % 2 else 0.02)
             for i, s in enumerate(segments)]
    return torch.cat(parts).to(dtype)


# ---------------------------------------------------------------------------------------------
# the collectives as FSDP2 calls them

@pytest.mark.parametrize("backend,dtype,async_op", [
    ("mpicomm", torch.float32, False), ("mpicomm", torch.bfloat16, True),
    ("gloo", torch.bfloat16, False), ("gloo", torch.float32, True)])
def test_all_gather_matches_simulation(groups, world, backend, dtype, async_op):
    group, rank, size = groups[backend], world.rank, world.size
    segments = (20, 10, 7)  # 37 elements: blocks of 8 with a short tail in every segment
    n = sum(segments)
    comm = QuantizedAllGather(bits=8, block=BLOCK, segments=segments)
    out = comm.allocate((size * n,), dtype=dtype, device=torch.device("cpu"))
    inp = out.narrow(0, rank * n, n)  # FSDP2 gathers in place: the input is this rank's slice
    inp.copy_(_shard(rank, n, dtype, segments))
    work = comm(out, inp, group, async_op=async_op)
    assert_all(isinstance(work, dist.Work) if async_op else work is None, repr(work))
    if async_op:
        work.wait()
    rows = [_shard(r, n, dtype, segments).double().numpy() for r in range(size)]
    expected = np.concatenate([rows[r] if r == rank else _sim(rows[r], segments, dtype)
                               for r in range(size)])
    assert_close_all(out.double(), expected, what=f"all-gather {backend} {dtype}")
    assert_all(bool(torch.equal(out.view(size, n)[rank], _shard(rank, n, dtype, segments))),
               "own slice exact")


def test_all_gather_of_a_negative_view_of_the_own_slice(groups, world):
    """The input aliases this rank's slice of the output but reads negated (torch's negative
    bit): the own slice must hold the negated values, not the raw memory."""
    rank, size, n = world.rank, world.size, 16
    comm = QuantizedAllGather(bits=8, block=BLOCK)
    out = comm.allocate((size * n,), dtype=torch.float32, device=torch.device("cpu"))
    raw = _shard(rank, n, torch.float32, (n,))
    out.narrow(0, rank * n, n).copy_(raw)
    comm(out, torch._neg_view(out.narrow(0, rank * n, n)), groups["mpicomm"])
    assert_all(bool(torch.equal(out.view(size, n)[rank], -raw)), "own slice negated")
    with pytest.raises(ValueError, match="negative bit"):  # every rank, before any message
        comm(torch._neg_view(out), raw, groups["mpicomm"])


def test_calls_in_flight_and_reuse(groups, world):
    """Two async all-gathers of one shape in flight at once (waited in reverse order) and the
    same shape called again: the reused send/receive buffers never mix two calls' data."""
    group, rank, size = groups["mpicomm"], world.rank, world.size
    segments = (24, 9)
    n = sum(segments)
    comm = QuantizedAllGather(bits=8, block=BLOCK, segments=segments)
    outs, works = [], []
    for k in range(3):
        out = torch.empty(size * n)
        inp = out.narrow(0, rank * n, n)
        inp.copy_(_shard(rank + 17 * k, n, torch.float32, segments))
        outs.append(out)
        works.append(comm(out, inp, group, async_op=k < 2))
    for work in reversed(works[:2]):
        work.wait()
    for k, out in enumerate(outs):
        rows = [_shard(r + 17 * k, n, torch.float32, segments).double().numpy() for r in range(size)]
        expected = np.concatenate([rows[r] if r == rank else _sim(rows[r], segments, torch.float32)
                                   for r in range(size)])
        assert_close_all(out.double(), expected, what=f"call {k}")


def _op(name: str):
    return {"sum": (dist.ReduceOp.SUM, 1.0), "avg": (dist.ReduceOp.AVG, None),
            "premul": (dist.ReduceOp.PREMUL_SUM(0.25), 0.25)}[name]


@pytest.mark.parametrize("backend,dtype,opname", [
    ("mpicomm", torch.float32, "sum"), ("mpicomm", torch.bfloat16, "avg"),
    ("mpicomm", torch.float32, "premul"), ("gloo", torch.bfloat16, "premul"),
    ("gloo", torch.float32, "avg")])
def test_reduce_scatter_matches_simulation(groups, world, backend, dtype, opname):
    group, rank, size = groups[backend], world.rank, world.size
    segments = (13, 4)
    m = sum(segments)
    comm = QuantizedReduceScatter(bits=8, block=BLOCK, segments=segments)

    def chunks(r):  # rank r's input: one row per destination
        return torch.stack([_shard(10 * r + j, m, dtype, segments) for j in range(size)])
    inp = comm.allocate((size * m,), dtype=dtype, device=torch.device("cpu"))
    inp.copy_(chunks(rank).reshape(-1))
    out = comm.allocate((m,), dtype=dtype, device=torch.device("cpu"))
    op, factor = _op(opname)
    work = comm(out, inp, group, op, async_op=opname == "avg")
    if work is not None:
        assert_all(isinstance(work, dist.Work), repr(work))
        work.wait()
        assert_all(work.is_completed(), "work not completed after wait()")
    total = np.zeros(m)
    for r in range(size):
        row = chunks(r)[rank].double().numpy()
        total += row if r == rank else _sim(row, segments, torch.float32)
    total *= factor if factor is not None else 1.0 / size
    exact = sum(chunks(r)[rank].double() for r in range(size)) * (factor or 1.0 / size)
    expected = torch.from_numpy(total).float().to(dtype).double().numpy()
    tol = 1e-5 * np.abs(expected).max() if dtype == torch.float32 else 2 ** -7 * np.abs(expected)
    assert_close_all(out.double(), expected, atol=tol if np.isscalar(tol) else 0,
                     rtol=0 if np.isscalar(tol) else 2 ** -7, what=f"reduce-scatter {backend}")
    if size > 1:  # the peers' chunks really travelled quantized
        assert_all(float((out.double() - exact).abs().max()) > 0, "no quantization error at all")


def test_bad_calls_raise_everywhere(groups, world):
    size = world.size
    inp, out = torch.zeros(size * 4), torch.zeros(4)

    def bad_op():
        for bits in (8, 1):
            comm = QuantizedReduceScatter(bits=bits, block=BLOCK)
            for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
                with pytest.raises(ValueError, match=f"expected reduce op SUM or AVG.*got "
                                                     f"{op.name}"):
                    comm(out, inp, groups["mpicomm"], op)
            assert bits == 8 or comm.state_dict()["worker_error"] is None  # nothing started
    check_all(bad_op)

    def bad_bits():
        for bits in (1, 4, 16, True, "8"):
            with pytest.raises(ValueError, match=r"expected bits in \(8,\)"):
                QuantizedAllGather(bits=bits)
            with pytest.raises(ValueError, match=r"weight_bits: expected bits in \(None, 8\)"):
                quantize_comms(torch.nn.Linear(2, 2), weight_bits=bits)
        for bits in (4, 16, True, "8", 0):
            with pytest.raises(ValueError, match=r"expected bits in \(8, 1\)"):
                QuantizedReduceScatter(bits=bits)
            with pytest.raises(ValueError, match=r"grad_bits: expected bits in \(None, 8, 1\)"):
                quantize_comms(torch.nn.Linear(2, 2), grad_bits=bits)
        with pytest.raises(ValueError, match="positive number of elements"):
            QuantizedAllGather(block=0)
        with pytest.raises(ValueError, match="no FSDPModule under Sequential"):
            quantize_comms(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    check_all(bad_bits)


# ---------------------------------------------------------------------------------------------
# on FSDP2

def _model(seed=0):
    torch.manual_seed(seed)
    # 7 and 5 output rows: uneven shards and FSDP2's dim-0 padding at 2, 3 and 4 ranks
    return torch.nn.Sequential(torch.nn.Linear(12, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))


def _shard_all(model, mesh, mp=None, reshard_first=True):
    for i, layer in enumerate(model):
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp or MixedPrecisionPolicy(),
                        reshard_after_forward=reshard_first or i > 0)
    fully_shard(model, mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())
    return model


def _rows(full: list[torch.Tensor], w: int) -> tuple[list[np.ndarray], tuple[int, ...]]:
    """Rank r's FSDP2 shard row of a module's parameters (dim 0 padded to w chunks)."""
    rows, segments = [[] for _ in range(w)], []
    for t in full:
        chunk = -(-t.shape[0] // w)
        padded = torch.zeros((chunk * w,) + tuple(t.shape[1:]), dtype=torch.float64)
        padded[:t.shape[0]] = t.double()
        for r in range(w):
            rows[r].append(padded[r * chunk:(r + 1) * chunk].reshape(-1).numpy())
        segments.append(chunk * int(np.prod(t.shape[1:], dtype=np.int64)))
    return [np.concatenate(r) for r in rows], tuple(segments)


def _unrow(row: np.ndarray, full: list[torch.Tensor], w: int, r: int) -> list[np.ndarray]:
    """Rank r's shard of each parameter (padding dropped) from a row."""
    out, pos = [], 0
    for t in full:
        chunk = -(-t.shape[0] // w)
        inner = int(np.prod(t.shape[1:], dtype=np.int64))
        piece = row[pos:pos + chunk * inner].reshape((chunk,) + tuple(t.shape[1:]))
        keep = max(0, min(chunk, t.shape[0] - r * chunk))
        out.append(piece[:keep])
        pos += chunk * inner
    return out


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_fsdp_gathered_weights_match_simulation(groups, world, param_dtype):
    """The working copy FSDP2 gathers: own slice exact, peers' dequantized; masters untouched."""
    check_gathered(world, init_device_mesh("cpu", (world.size,)), param_dtype)


def check_gathered(world, mesh, param_dtype, device=torch.device("cpu")) -> None:
    """FSDP2's gathered weights with ``quantize_comms(weight_bits=8)`` on ``mesh`` (a 1-D mesh
    of ``device``) against the simulation; the masters untouched, every tensor on ``device``."""
    rank, size = mesh.get_local_rank(), mesh.size()
    model = _shard_all(_model(), mesh, MixedPrecisionPolicy(param_dtype=param_dtype))
    names = quantize_comms(model, weight_bits=8, grad_bits=None, block=BLOCK)
    assert_all(names == ["0", "2"], str(names))
    model(torch.randn(3, 12).to(device))  # lazy init; every module resharded after forward
    for i, layer in ((0, model[0]), (2, model[2])):
        masters = [p.full_tensor().detach().cpu().clone() for p in layer.parameters()]
        full = [m.to(param_dtype) for m in masters]
        rows, segments = _rows(full, size)
        expected = [np.concatenate(parts) for parts in zip(*[
            _unrow(rows[r] if r == rank else _sim(rows[r], segments, param_dtype), full, size, r)
            for r in range(size)])]
        handle = layer.unshard(async_op=i == 2)
        if handle is not None:
            handle.wait()
        assert_all(all(p.device == device for p in (layer.weight, layer.bias)),
                   f"layer {i}: gathered weights on {layer.weight.device}, expected {device}")
        got = [layer.weight.detach().double().cpu().numpy(),
               layer.bias.detach().double().cpu().numpy()]
        layer.reshard()
        for g, e, name in zip(got, expected, ("weight", "bias")):
            assert_close_all(g, e, what=f"layer {i} {name} ({param_dtype})")
        after = [p.full_tensor().detach().cpu() for p in layer.parameters()]
        assert_all(all(torch.equal(a, b) for a, b in zip(after, masters)), "masters changed")


def _local_grads(x: torch.Tensor) -> list[list[torch.Tensor]]:
    """This rank's gradients (on the host) of each Linear of the plain model on input ``x``,
    computed on ``x``'s device."""
    plain = _model().to(x.device)
    torch.nn.functional.mse_loss(plain(x), torch.zeros(x.shape[0], 5, device=x.device)).backward()
    return [[p.grad.detach().cpu().clone() for p in plain[i].parameters()] for i in (0, 2)]


def check_grads(world, mesh, replicate: int, reshard_first: bool,
                device=torch.device("cpu")):
    """FSDP2's sharded gradients with ``quantize_comms(grad_bits=8)`` on ``mesh`` (of
    ``device``; ``(replicate, shard)`` for HSDP) against the simulation, on ``device``."""
    rank, size = world.rank, world.size
    shard = size // replicate
    model = _shard_all(_model(), mesh, reshard_first=reshard_first)
    quantize_comms(model, weight_bits=None, grad_bits=8, block=BLOCK)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(7 + rank)).to(device)
    for _ in range(2 if not reshard_first else 1):  # a second forward on the kept-unsharded module
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), torch.zeros(4, 5, device=device)).backward()
    everyone = world.allgather([[g.numpy() for g in layer] for layer in _local_grads(x)])
    i_rep, j = divmod(rank, shard)  # mesh (replicate, shard): the shard group is one row
    for li, idx in enumerate((0, 2)):
        full = [torch.from_numpy(t) for t in everyone[0][li]]
        total = None
        for i in range(replicate):
            members = [i * shard + s for s in range(shard)]
            rows = [_rows([torch.from_numpy(t) for t in everyone[r][li]], shard) for r in members]
            segments = rows[0][1]
            acc = np.zeros_like(rows[0][0][j])
            for s, (rr, _) in enumerate(rows):
                acc += rr[j] if s == j else _sim(rr[j], segments, torch.float32)
            acc /= shard
            total = acc if total is None else total + acc
        total /= replicate
        expected = _unrow(total, full, shard, j)
        grads = [p.grad._local_tensor for p in model[idx].parameters()]
        assert_all(all(g.device == device for g in grads), f"gradients on {grads[0].device}")
        got = [g.detach().double().cpu().numpy() for g in grads]
        for g, e in zip(got, expected):
            assert_close_all(g, e, atol=1e-6 * max(1.0, float(np.abs(e).max(initial=0))),
                             what=f"layer {idx} gradient")
    return model


@pytest.mark.parametrize("reshard_first", [True, False])
def test_fsdp_gradients_match_simulation(groups, world, reshard_first):
    mesh = init_device_mesh("cpu", (world.size,))
    check_grads(world, mesh, 1, reshard_first)


@pytest.mark.mpi(min_size=4)
def test_hsdp_gradients_match_simulation(groups, world):
    if world.size % 2:
        pytest.skip("HSDP test uses a (2, size/2) mesh")
    mesh = init_device_mesh("cpu", (2, world.size // 2), mesh_dim_names=("replicate", "shard"))
    check_grads(world, mesh, 2, True)


def test_two_parameter_groups_refused_by_name(groups, world):
    from torch.distributed.fsdp._fully_shard._fsdp_common import (FSDPMeshInfo,
                                                                  ShardPlacementResult)
    mesh = init_device_mesh("cpu", (world.size,))
    other = DeviceMesh.from_group(groups["gloo"], "cpu")
    info = FSDPMeshInfo(mesh=other, shard_mesh_dim=0)
    model = _model()
    fully_shard(model[2], mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(
        placement=None, mesh_info=info) if p.ndim == 1 else None)

    def check():
        with pytest.raises(ValueError, match="FSDPModule '2' .*2 parameter groups"):
            quantize_comms(model)
    check_all(check)


def test_training_then_checkpoint_holds_masters(groups, world, comm, shared_tmp_path):
    """ckpt.save of the quantized FSDP2 model writes the exact masters (no quantized copy)."""
    import ckpt
    mesh = init_device_mesh("cpu", (world.size,))
    model = _shard_all(_model(), mesh, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    quantize_comms(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(world.rank))
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).float(), torch.zeros(4, 5)).backward()
        opt.step()
    masters = [p.full_tensor().detach().clone() for p in model.parameters()]
    ckpt.save(shared_tmp_path / "q", model=model, comm=comm)
    fresh = _shard_all(_model(seed=5), mesh)
    ckpt.load(shared_tmp_path / "q", model=fresh, comm=comm)
    loaded = [p.full_tensor().detach() for p in fresh.parameters()]
    assert_all(all(torch.equal(a, b) for a, b in zip(loaded, masters)), "loaded != masters")
    assert_all(all(p.dtype == torch.float32 for p in loaded), "a saved tensor is not fp32")


def test_prefetched_async_unshard_matches_blocking(groups, world):
    """FSDP2's explicit prefetching with async unshards (the quantized all-gather's async work,
    waited by FSDP2) gives bit for bit the blocking run's losses and gradients."""
    mesh = init_device_mesh("cpu", (world.size,))

    def make(prefetch: bool):
        model = _shard_all(_model(), mesh)
        quantize_comms(model, weight_bits=8, grad_bits=8, block=BLOCK)
        if prefetch:
            for layer in (model[0], model[2]):
                layer._set_unshard_async_op(True)  # torch's (private) switch for prefetches
            model[0].set_modules_to_forward_prefetch([model[2]])
            model[2].set_modules_to_backward_prefetch([model[0]])
        return model
    plain, fetched = make(False), make(True)
    for step in range(2):
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(step + world.rank))
        losses = [m(x).pow(2).mean() for m in (plain, fetched)]
        for loss in losses:
            loss.backward()
        grads = [torch.cat([p.grad._local_tensor.reshape(-1) for p in m.parameters()])
                 for m in (plain, fetched)]
        assert_all(float(losses[0]) == float(losses[1]) and torch.equal(*grads),
                   f"step {step}: prefetched run differs from the blocking one")
