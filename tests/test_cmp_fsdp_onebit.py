"""compressed.fsdp's 1-bit gradient reduce-scatter (bits=1, error feedback) against a float64
simulation of the 1-bit engine's reduce-scatter phase over several steps: uneven shards (rows
not a multiple of 8), bf16 and fp32, SUM/AVG/PREMUL_SUM, on mpicomm and gloo groups; FSDP2's
gradients with quantize_comms(grad_bits=1); the error state through ckpt."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import mpicomm  # noqa: F401 - registers the backend
from compressed.fsdp import QuantizedReduceScatter, quantize_comms
from mpitest import assert_all, assert_close_all, check_all
from test_cmp_fsdp import _local_grads, _model, _rows, _shard_all, _unrow
from test_cmp_fsdp import groups  # noqa: F401 - the fixture: the mpicomm world and a gloo group

pytestmark = pytest.mark.mpi(min_size=1)


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


# ---------------------------------------------------------------------------------------------
# on FSDP2, and the error state through ckpt

def _fsdp_model(mesh, seed=0, weight_bits=8, warmup_steps=0):
    model = _shard_all(_model(seed), mesh)
    quantize_comms(model, weight_bits=weight_bits, grad_bits=1, warmup_steps=warmup_steps)
    return model


def _backward(model, rank: int, steps: int) -> None:
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(7 + rank))
    for _ in range(steps):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x).float(), torch.zeros(4, 5)).backward()


def check_grads(world, mesh, replicate: int, steps: int = 3, device=torch.device("cpu"),
                warmup: int = 0):
    """FSDP2's sharded gradients after each of ``steps`` backward passes (same weights, same
    local gradients: the error feedback alone changes the result) against the simulation; a
    ``(replicate, shard)`` mesh averages the shard groups' results exactly (FSDP2's all-reduce).
    ``mesh`` of ``device``: gradients and error states must stay there. The first ``warmup``
    steps: the exact mean (full precision), the error starting at zero after them."""
    rank, size = world.rank, world.size
    shard = size // replicate
    i_rep, j = divmod(rank, shard)  # mesh (replicate, shard): the shard group is one row
    model = _fsdp_model(mesh, weight_bits=None, warmup_steps=warmup)  # exact weights
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(7 + rank)).to(device)
    everyone = world.allgather([[g.numpy() for g in layer] for layer in _local_grads(x)])
    errors = {}
    for step in range(steps):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), torch.zeros(4, 5, device=device)).backward()
        for li, idx in enumerate((0, 2)):
            full = [torch.from_numpy(t) for t in everyone[0][li]]
            total = 0.0
            for i in range(replicate):
                members = [i * shard + s for s in range(shard)]
                rows = [np.stack(_rows([torch.from_numpy(t) for t in everyone[r][li]], shard)[0])
                        for r in members]
                if shard == 1:
                    total = total + rows[0][0]
                    continue
                if step < warmup:
                    total = total + sum(r[j] for r in rows) / shard
                    continue
                e = errors.setdefault((idx, i), [np.zeros(shard * (-(-rows[0].shape[1] // 8) * 8))
                                                 for _ in range(shard)])
                total = total + simulate_step(rows, e)[j]
            expected = _unrow(total / replicate, full, shard, j)
            grads = [p.grad._local_tensor for p in model[idx].parameters()]
            assert_all(all(g.device == device for g in grads), f"gradients on {grads[0].device}")
            got = [g.detach().double().cpu().numpy() for g in grads]
            for g, want in zip(got, expected):
                assert_close_all(g, want, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(want).max(
                    initial=0))), what=f"step {step} layer {idx} gradient")
    return model


def test_fsdp_gradients_match_simulation(groups, world):
    check_grads(world, init_device_mesh("cpu", (world.size,)), 1)


def test_fsdp_warmup_then_onebit(groups, world):
    """quantize_comms(grad_bits=1, warmup_steps=2): two steps of exact mean gradients, then the
    1-bit simulation from a zero error."""
    check_grads(world, init_device_mesh("cpu", (world.size,)), 1, steps=4, warmup=2)


@pytest.mark.parametrize("backend,async_op", [("mpicomm", False), ("gloo", True)])
def test_warmup_calls_are_full_precision(groups, world, backend, async_op):
    """QuantizedReduceScatter(bits=1, warmup_steps=2): calls 1-2 give the exact AVG (fp32 sum
    of every rank's row over ranks) and leave no error; calls 3-4 match the 1-bit simulation
    started from a zero error; the step count is in state_dict()."""
    group, rank, size = groups[backend], world.rank, world.size
    m = 13
    comm = QuantizedReduceScatter(bits=1, warmup_steps=2)
    errors = [np.zeros(size * 16) for _ in range(size)]
    for step in range(4):
        inputs = [_input(step, r, size, m, torch.float32) for r in range(size)]
        out = torch.empty(m)
        work = comm(out, inputs[rank].reshape(-1).clone(), group, dist.ReduceOp.AVG,
                    async_op=async_op)
        if work is not None:
            work.wait()
        assert_all(comm.state_dict()["steps"] == step + 1, f"steps {comm.state_dict()['steps']}")
        if step < 2 or size == 1:
            want = sum(t[rank].double() for t in inputs).numpy() / size
            assert_close_all(out.double().numpy(), want, rtol=1e-6, atol=1e-6,
                             what=f"warm-up call {step}")
            assert_all(step >= 2 or comm.state_dict()["worker_error"] is None,
                       "an error state during the warm-up")
            continue
        want = simulate_step([t.double().numpy() for t in inputs], errors)[rank]
        assert_close_all(out.double().numpy(), want, rtol=1e-5, atol=1e-6 * float(
            np.abs(want).max()), what=f"1-bit call {step}")


def test_bad_warmup_raises(world):
    def bad():
        for value in (-1, 1.5, True, "3"):
            with pytest.raises(ValueError, match=r"expected warmup_steps as a whole number"):
                quantize_comms(torch.nn.Linear(2, 2), grad_bits=1, warmup_steps=value)
            with pytest.raises(ValueError, match=r"expected warmup_steps as a whole number"):
                QuantizedReduceScatter(bits=1, warmup_steps=value)
        for bits in (8, None):
            with pytest.raises(ValueError, match=r"warmup_steps=5 applies to 1-bit gradients"):
                quantize_comms(torch.nn.Linear(2, 2), grad_bits=bits, warmup_steps=5)
        with pytest.raises(ValueError, match=r"warmup_steps=5 applies to 1-bit gradients"):
            QuantizedReduceScatter(bits=8, warmup_steps=5)
        with pytest.raises(ValueError, match=r"saved step count"):
            QuantizedReduceScatter(bits=1).load_state_dict(
                {"world_size": None, "numel": None, "worker_error": None, "steps": -2})
    check_all(bad)


@pytest.mark.mpi(min_size=4)
def test_hsdp_gradients_match_simulation(groups, world):
    """HSDP on a (2, size/2) mesh: 1-bit within each shard group, FSDP2's exact all-reduce
    across the two; each shard group's error feedback its own."""
    if world.size % 2:
        pytest.skip("HSDP test uses a (2, size/2) mesh")
    mesh = init_device_mesh("cpu", (2, world.size // 2), mesh_dim_names=("replicate", "shard"))
    check_grads(world, mesh, 2, steps=2)


@pytest.mark.parametrize("backend", ["mpicomm", "gloo"])
def test_async_calls_match_blocking(groups, world, backend):
    """Two 1-bit reduce-scatters in flight at once (started A then B, waited B then A) give bit
    for bit the outputs and errors of the same calls made blocking, over 3 steps; a third
    call on A before A's wait finishes A's first."""
    group, rank, size = groups[backend], world.rank, world.size
    m = 19
    blocking = [QuantizedReduceScatter(bits=1) for _ in range(2)]
    in_flight = [QuantizedReduceScatter(bits=1) for _ in range(2)]
    for step in range(3):
        inputs = [_input(step, rank + 10 * k, size, m, torch.float32).reshape(-1) for k in (0, 1)]
        want = [torch.empty(m) for _ in range(2)]
        for comm, out, inp in zip(blocking, want, inputs):
            assert_all(comm(out, inp.clone(), group, dist.ReduceOp.AVG) is None, "not None")
        got = [torch.full((m,), float("nan")) for _ in range(2)]
        kept = [inp.clone() for inp in inputs]
        works = [comm(out, inp, group, dist.ReduceOp.AVG, async_op=True)
                 for comm, out, inp in zip(in_flight, got, kept)]
        assert_all(size == 1 or not any(w.is_completed() for w in works),
                   "a work completed before its wait()")
        for w in reversed(works):
            w.wait()
            w.wait()  # a second wait changes nothing
        for k in (0, 1):
            assert_all(torch.equal(got[k], want[k]), f"step {step} call {k}: output differs")
            assert_all(size == 1 or torch.equal(in_flight[k].state_dict()["worker_error"],
                                                blocking[k].state_dict()["worker_error"]),
                       f"step {step} call {k}: worker error differs")
    # a call on an object whose previous call is in flight finishes that one first
    inp = _input(5, rank, size, m, torch.float32).reshape(-1)
    first, second = torch.empty(m), torch.empty(m)
    w1 = in_flight[0](first, inp.clone(), group, dist.ReduceOp.SUM, async_op=True)
    w2 = in_flight[0](second, inp.clone(), group, dist.ReduceOp.SUM, async_op=True)
    assert_all(w1.is_completed() or size == 1, "the first call not finished by the second")
    w2.wait()
    b1, b2 = torch.empty(m), torch.empty(m)
    blocking[0](b1, inp.clone(), group, dist.ReduceOp.SUM)
    blocking[0](b2, inp.clone(), group, dist.ReduceOp.SUM)
    assert_all(torch.equal(first, b1) and torch.equal(second, b2), "back-to-back calls differ")


def test_error_state_through_ckpt(groups, world, comm, shared_tmp_path):
    """ckpt.save / ckpt.load of GradientErrors: bit-identical at the same size; at one rank (a
    sub-communicator of each rank alone) the new error is the mean of the saved ones, per
    parameter position; the checkpoint holds fp32 masters and errors only."""
    from mpi4py import MPI

    import ckpt
    from compressed.fsdp import GradientErrors
    from compressed.fsdp.error_state import unpack
    rank, size = world.rank, world.size
    mesh = init_device_mesh("cpu", (size,))
    model = _fsdp_model(mesh)
    _backward(model, rank, 2)
    state = GradientErrors(model)
    assert_all(sorted(state.targets) == ["0", "2"], str(sorted(state.targets)))
    mine = state.per_rank_state_dict()["modules"]
    assert_all(all(float(v["worker_error"].abs().max()) > 0 for v in mine.values()) or size == 1,
               "no error feedback after two steps")
    ckpt.save(shared_tmp_path / "e", model=model, comm=comm, state={"grad_errors": state})
    fresh = _fsdp_model(mesh, seed=3)
    ckpt.load(shared_tmp_path / "e", model=fresh, comm=comm,
              state={"grad_errors": GradientErrors(fresh)})
    again = GradientErrors(fresh).per_rank_state_dict()["modules"]
    assert_all(all(torch.equal(again[k]["worker_error"], mine[k]["worker_error"]) for k in mine),
               "errors not bit-identical after a same-size load")
    assert_all(all(int(again[k]["steps"]) == int(mine[k]["steps"]) == (2 if size > 1 else 0)
                   for k in mine), "step counts not kept")  # FSDP2 reduces nothing at 1 rank
    # N -> 1: every rank alone loads the checkpoint saved by all
    saved = world.allgather({k: (v["shapes"], v["worker_error"].numpy()) for k, v in mine.items()})
    alone = None
    for r in range(size):  # new_group is collective: every rank creates every 1-rank group
        g = dist.new_group([r])
        if r == rank:
            alone = g
    from torch.distributed.device_mesh import DeviceMesh
    solo = _fsdp_model(DeviceMesh.from_group(alone, "cpu"), seed=4)
    ckpt.load(shared_tmp_path / "e", model=solo, comm=MPI.COMM_SELF,
              state={"grad_errors": GradientErrors(solo)})
    got = GradientErrors(solo).per_rank_state_dict()["modules"]
    assert_all(all(int(got[k]["steps"]) == int(mine[k]["steps"]) for k in mine),
               "step counts not kept at 1 rank")
    for k in mine:
        shapes = saved[0][k][0]
        owed = [sum(parts) / size for parts in zip(*[
            unpack(torch.from_numpy(s[k][1]), shapes, size) for s in saved])]
        have = unpack(got[k]["worker_error"], shapes, 1)
        assert_close_all(torch.cat([h.reshape(-1) for h in have]).numpy(),
                         torch.cat([o.reshape(-1) for o in owed]).numpy(), rtol=1e-6, atol=1e-7,
                         what=f"module {k} error at 1 rank")


@pytest.mark.mpi(min_size=4)
def test_error_state_resharded_to_half_the_ranks(groups, world, comm, shared_tmp_path):
    """N -> N/2 through ckpt: each half of the ranks loads the checkpoint all N saved, on a mesh
    of its own; every new rank's error, put back on the parameters' positions, is the mean of
    the saved ranks' (laid out for N/2 rows)."""
    import ckpt
    from compressed.fsdp import GradientErrors
    from compressed.fsdp.error_state import unpack
    from torch.distributed.device_mesh import DeviceMesh
    rank, size = world.rank, world.size
    if size % 2:
        pytest.skip("loads on two halves of the ranks")
    half = size // 2
    model = _fsdp_model(init_device_mesh("cpu", (size,)))
    _backward(model, rank, 2)
    state = GradientErrors(model)
    ckpt.save(shared_tmp_path / "e", model=model, comm=comm, state={"grad_errors": state})
    mine = state.per_rank_state_dict()["modules"]
    saved = world.allgather({k: (v["shapes"], v["worker_error"].numpy()) for k, v in mine.items()})
    halves = [dist.new_group(list(range(c * half, (c + 1) * half))) for c in (0, 1)]
    sub = world.Split(rank // half, rank)
    try:
        fresh = _fsdp_model(DeviceMesh.from_group(halves[rank // half], "cpu"), seed=4)
        ckpt.load(shared_tmp_path / "e", model=fresh, comm=sub,
                  state={"grad_errors": GradientErrors(fresh)})
        got = GradientErrors(fresh).per_rank_state_dict()["modules"]
    finally:
        sub.Free()
    assert_all(sorted(got) == sorted(mine), f"modules {sorted(got)}")
    for k in mine:
        shapes = saved[0][k][0]
        owed = [sum(parts) / size for parts in zip(*[
            unpack(torch.from_numpy(s[k][1]), shapes, size) for s in saved])]
        assert_all(got[k]["world_size"] == half, f"module {k}: world {got[k]['world_size']}")
        have = unpack(got[k]["worker_error"], shapes, half)
        assert_close_all(torch.cat([h.reshape(-1) for h in have]).numpy(),
                         torch.cat([o.reshape(-1) for o in owed]).numpy(), rtol=1e-6, atol=1e-7,
                         what=f"module {k} error at {half} ranks")


def test_error_layout_pack_unpack(world):
    """``pack`` / ``unpack`` (pure): FSDP2's dim-0 chunks with padding at 1-4 ranks, and the
    N -> M rule keeps the mean owed per parameter position (2 saved ranks -> 3)."""
    from compressed.fsdp.error_state import pack, unpack
    g = torch.Generator().manual_seed(3)
    shapes = [[7, 3], [5], [1, 4]]
    params = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
    for w in (1, 2, 3, 4):
        packed = pack(params, w)
        m = sum(-(-s[0] // w) * int(np.prod(s[1:], dtype=np.int64)) for s in shapes)
        assert packed.numel() == w * (-(-m // 8) * 8) and packed.dtype == torch.float32
        rows = packed.view(w, -1)
        # row j starts with dim-0 chunk j of the first parameter (7 rows of 3, chunk ceil(7/w))
        c = -(-7 // w)
        want = torch.zeros(c * w, 3, dtype=torch.float64)
        want[:7] = params[0]
        assert torch.equal(rows[:, :c * 3], want.reshape(w, c * 3).float())
        back = unpack(packed, shapes, w)
        assert all(torch.equal(b, p.float().double()) for b, p in zip(back, params))
    saved = [pack([p * (i + 1) for p in params], 2) for i in range(2)]
    owed = [sum(parts) / 2 for parts in zip(*[unpack(s, shapes, 2) for s in saved])]
    three = pack(owed, 3)
    assert all(torch.allclose(a, b.float().double()) for a, b in zip(unpack(three, shapes, 3), owed))
    with pytest.raises(ValueError, match="expected .* for parameters"):
        unpack(three, shapes, 4)


def test_warmup_progress_through_ckpt(groups, world, comm, shared_tmp_path):
    """A checkpoint taken during the warm-up (2 of 5 steps) resumes at step 2: the resumed
    model's next 3 steps are full precision (no error yet), the 4th compresses; a state saved
    without a step count (before the warm-up existed) counts as past the warm-up."""
    import ckpt
    from compressed.fsdp import GradientErrors
    rank, size = world.rank, world.size
    if size == 1:
        pytest.skip("FSDP2 calls no reduce-scatter at one rank: no steps to count")
    mesh = init_device_mesh("cpu", (size,))
    model = _fsdp_model(mesh, warmup_steps=5)
    _backward(model, rank, 2)
    ckpt.save(shared_tmp_path / "w", model=model, comm=comm,
              state={"grad_errors": GradientErrors(model)})
    fresh = _fsdp_model(mesh, seed=3, warmup_steps=5)
    ckpt.load(shared_tmp_path / "w", model=fresh, comm=comm,
              state={"grad_errors": GradientErrors(fresh)})
    states = [rs.onebit for _, rs in GradientErrors(fresh).targets.values()]
    assert_all(all(st.steps == 2 for st in states), f"steps {[st.steps for st in states]}")
    _backward(fresh, rank, 3)
    assert_all(all(st.steps == 5 and float(st.worker_error.abs().max()) == 0 for st in states),
               "an error grew during the warm-up")
    _backward(fresh, rank, 1)
    assert_all(all(float(st.worker_error.abs().max()) > 0 for st in states),
               "no error feedback after the warm-up")
    old = QuantizedReduceScatter(bits=1, warmup_steps=5)
    old.load_state_dict({"world_size": 1, "numel": 3, "worker_error": torch.zeros(8)})
    assert_all(old.onebit.steps == 5 and not old.onebit.count_step(), "old state still warming")
