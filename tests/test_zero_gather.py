"""ZeroOptimizer(gather_bits=8): int8 weight all-gather per block (ZeRO++ qwZ style).

References: a numpy implementation of the quantizer (bytes, values and the documented error
bound), the fp32 masters gathered with a plain mpi4py allgather, unquantized training for the
loss, and the checkpoint's data file read with safetensors for "exact masters saved".
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

import ckpt
import compressed
import mpicomm
from mpitest import assert_all, assert_close_all, check_all
from zero import ZeroOptimizer
from zero.quantize import BLOCK, dequantize, packed_bytes, quantize_into

WORLD = MPI.COMM_WORLD
MODES = [pytest.param("mpi", marks=pytest.mark.mpi, id="mpi"), pytest.param("one", id="one")]


pytestmark = pytest.mark.usefixtures("one_thread")


# -- the quantizer against numpy --------------------------------------------------------------

def np_quantize(x: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per block: scales (fp32) and values (int8), as docs/zero.md states it."""
    x = x.astype(np.float32)
    nb = -(-len(x) // block)
    scales = np.zeros(nb, np.float32)
    q = np.zeros(len(x), np.int8)
    for b in range(nb):
        blk = x[b * block:(b + 1) * block]
        s = np.float32(np.abs(blk).max()) / np.float32(127)
        scales[b] = s
        if s > 0:
            q[b * block:(b + 1) * block] = np.clip(np.rint(blk / s), -127, 127).astype(np.int8)
    return scales, q


def np_dequantize(scales: np.ndarray, q: np.ndarray, block: int = BLOCK) -> np.ndarray:
    return (q.astype(np.float32) * np.repeat(scales, block)[:len(q)]).astype(np.float32)


def _vector(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-8, 4, n))).astype(np.float32)
    if n > BLOCK:
        x[BLOCK:2 * BLOCK] = 0.0                        # an all-zero block
    if n > 3:
        x[1] = 0.5 * (np.abs(x[:BLOCK]).max() / 127)   # near a rounding tie
    return x


@pytest.mark.parametrize("n", [0, 1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 10000])
def test_quantizer_matches_numpy(n):
    x = _vector(n, seed=n)
    row = torch.full((packed_bytes(n),), 0xAB, dtype=torch.uint8)
    quantize_into(torch.from_numpy(x), row)
    scales, q = np_quantize(x)
    raw = row.numpy().tobytes()
    nb = len(scales)
    assert raw[:4 * nb] == scales.tobytes()
    assert raw[4 * nb:4 * nb + n] == q.tobytes()
    assert raw[4 * nb + n:] == bytes(len(raw) - 4 * nb - n)          # zero padding
    back = dequantize(row.view(1, -1), n)[0].numpy()
    np.testing.assert_array_equal(back, np_dequantize(scales, q))
    # the documented bound: |x - deq| <= max|block| / 254 * (1 + 2**-15) in each block
    for b in range(nb):
        sl = slice(b * BLOCK, (b + 1) * BLOCK)
        bound = np.abs(x[sl]).max() / 254 * (1 + 2.0 ** -15)
        assert np.abs(x[sl].astype(np.float64) - back[sl]).max() <= bound


def test_quantizer_rows_of_several_ranks_and_nonfinite_blocks():
    xs = [_vector(2 * BLOCK + 3, seed=s) for s in range(3)]
    xs[1][5] = np.inf
    xs[2][BLOCK + 1] = np.nan
    w = packed_bytes(len(xs[0]))
    rows = torch.empty(3, w, dtype=torch.uint8)
    for r, x in enumerate(xs):
        quantize_into(torch.from_numpy(x), rows[r])
    back = dequantize(rows, len(xs[0])).numpy()
    np.testing.assert_array_equal(back[0], np_dequantize(*np_quantize(xs[0])))
    assert np.isnan(back[1, :BLOCK]).all() and np.isfinite(back[1, BLOCK:]).all()   # that block only
    assert np.isnan(back[2, BLOCK:2 * BLOCK]).all()
    assert np.isfinite(back[2, :BLOCK]).all() and np.isfinite(back[2, 2 * BLOCK:]).all()


def test_gather_bits_other_than_none_or_8_is_refused():
    comm = mpicomm.init()
    p = [torch.nn.Parameter(torch.zeros(3))]
    for bad in (4, 16, 0, True, "8", 8.0):
        with pytest.raises(ValueError, match="gather_bits"):
            ZeroOptimizer(torch.optim.Adam, p, comm=comm, gather_bits=bad, lr=0.1)
    assert ZeroOptimizer(torch.optim.Adam, p, comm=comm, gather_bits=8, lr=0.1).gather_bits == 8


# -- training ----------------------------------------------------------------------------------

def make_model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4)).to(dtype)


def batch(rank: int, step: int):
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x @ w + 0.01 * torch.randn(32, 4, generator=g)


def train(model, opt, steps: int, rank: int) -> float:
    """Train ``steps`` steps; return the loss on a held-out batch."""
    dtype = next(model.parameters()).dtype
    for s in range(steps):
        opt.zero_grad()
        x, y = batch(rank, s)
        torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
        opt.step()
    x, y = batch(999, 10 ** 6)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y))


def full_masters(opt) -> list[np.ndarray]:
    """Every parameter's exact fp32 master, assembled from all ranks' shards (mpi4py allgather)."""
    out = []
    for g in opt.groups:
        shards = opt.comm.mpi_comm.allgather(g.master.numpy().copy()) if opt.world_size > 1 else [g.master.numpy()]
        full = [np.zeros(p.numel(), np.float32) for p in g.params]
        for r in range(opt.world_size):
            for s in g.layout.segments(r):
                full[s.param][s.start:s.start + s.length] = shards[r][s.local:s.local + s.length]
        out += full
    return out


def working_copy_reference(opt) -> list[np.ndarray]:
    """The model weights ``gather_bits=8`` should give: each rank's shard row quantized by numpy
    in blocks from column 0 (one bucket per group here), dequantized, put in place."""
    out = []
    for g in opt.groups:
        shards = opt.comm.mpi_comm.allgather(g.master.numpy().copy()) if opt.world_size > 1 else [g.master.numpy()]
        full = [np.zeros(p.numel(), np.float32) for p in g.params]
        for r in range(opt.world_size):
            row = np_dequantize(*np_quantize(shards[r]))
            for s in g.layout.segments(r):
                full[s.param][s.start:s.start + s.length] = row[s.local:s.local + s.length]
        out += full
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("inner", ["adam", "onebit"])
def test_training_with_int8_gather_stays_close(mode, stage, inner):
    comm = mpicomm.init()
    cls, kw = ((torch.optim.Adam, {}) if inner == "adam" else (compressed.OnebitAdam, {"freeze_step": 20}))
    losses = {}
    for bits in (None, 8):
        model = make_model()
        opt = ZeroOptimizer(cls, model.parameters(), stage=stage, comm=comm, gather_bits=bits, lr=1e-2, **kw)
        losses[bits] = train(model, opt, 100, comm.rank)
        if bits == 8:
            # the working copy is the numpy-dequantized masters, on every rank alike
            for p, ref in zip(model.parameters(), working_copy_reference(opt)):
                assert_close_all(p.detach().reshape(-1), ref, what="int8-gathered weights vs numpy")
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
            everyone = WORLD.allgather(flat.tobytes())
            assert_all(all(x == everyone[0] for x in everyone), "working copies differ between ranks")
            masters = full_masters(opt)
            assert_all(any(not np.array_equal(p.detach().reshape(-1).numpy(), m)
                           for p, m in zip(model.parameters(), masters)), "weights were not quantized at all")
        opt.close()
    assert_all(losses[8] <= 1.1 * losses[None], f"int8 gather loss {losses[8]} vs unquantized {losses[None]}")
    start = train(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.0), 0, comm.rank)
    assert_all(losses[8] < start / 20, f"loss {losses[8]} from {start}: did not train")


@pytest.mark.parametrize("mode", MODES)
def test_error_bound_holds_with_many_buckets(mode):
    comm = mpicomm.init()
    model = make_model()
    opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=1, comm=comm, gather_bits=8,
                        bucket_bytes=4 * 1000 * comm.size, lr=1e-2)      # buckets of 1000 columns
    train(model, opt, 3, comm.rank)
    masters = full_masters(opt)
    shards = WORLD.allgather(opt.groups[0].master.numpy().copy()) if comm.size > 1 else [opt.groups[0].master.numpy()]
    bound = max(np.abs(s).max() for s in shards) / 254 * (1 + 2.0 ** -15)    # any block's max <= this
    err = max(float(np.abs(p.detach().reshape(-1).numpy().astype(np.float64) - m).max())
              for p, m in zip(model.parameters(), masters))
    assert_all(0 < err <= bound, f"max |weight - master| {err}, bound {bound}")


# -- checkpoints -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_checkpoint_saves_exact_masters(mode, dtype, shared_tmp_path):
    from safetensors.torch import load_file

    comm = mpicomm.init()
    model = make_model(dtype)
    opt = ZeroOptimizer(torch.optim.Adam, model.parameters(), stage=1, comm=comm, gather_bits=8, lr=1e-2)
    train(model, opt, 5, comm.rank)
    masters = full_masters(opt)
    path = str(shared_tmp_path / "q")
    ckpt.save(path, model=model, optimizer=opt, step=5, comm=comm)

    def check_file():
        saved = load_file(f"{path}/data.bin")
        names = [n for n, _ in model.named_parameters()]
        differs = False
        for name, p, m in zip(names, model.parameters(), masters):
            t = saved[name]
            assert t.dtype == dtype, (name, t.dtype)
            want = torch.from_numpy(m).to(dtype)             # the exact master (cast to the model dtype)
            assert torch.equal(t.reshape(-1), want), f"{name}: data.bin holds not the master"
            differs = differs or not torch.equal(t.reshape(-1), p.detach().reshape(-1))
        assert differs, "the working copy equals the masters: nothing shows which one was saved"
    check_all(check_file)
    # loading into an unquantized optimizer gives back the exact masters
    model2 = make_model(dtype)
    opt2 = ZeroOptimizer(torch.optim.Adam, model2.parameters(), stage=2, comm=comm, lr=1e-2)
    ckpt.load(path, model=model2, optimizer=opt2, comm=comm)
    for a, b in zip(full_masters(opt2), masters):
        assert_close_all(a, b, what="masters after load")
    if dtype == torch.float32:
        for p, m in zip(model2.parameters(), masters):
            assert_close_all(p.detach().reshape(-1), m, what="unquantized weights after load")
