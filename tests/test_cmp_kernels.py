"""Compression kernels and layout against float64 numpy references (single process, no MPI)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import compressed
from compressed import kernels as K
from compressed import torch_kernels as TK
from compressed.layout import HEADER_BYTES, Layout, fp32_allreduce_wire_bytes

IMPLS = ["numpy"]
try:
    import numba  # noqa: F401
    IMPLS.append("numba")
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(params=IMPLS)
def impl(request):
    before = K.implementation()
    K.use(request.param)
    yield request.param
    K.use(before)


# ---- independent references -------------------------------------------------------------------
def ref_bits(x: np.ndarray) -> np.ndarray:
    """MSB-first packing of x >= 0, written bit by bit."""
    out = np.zeros(len(x) // 8, np.uint8)
    for i, v in enumerate(x):
        if v >= 0:
            out[i // 8] |= 1 << (7 - i % 8)
    return out


def ref_sign(x: np.ndarray) -> np.ndarray:
    return np.where(x >= 0, 1.0, -1.0)


def padded(g: np.ndarray, size: int) -> np.ndarray:
    x = np.zeros(size, np.float64)
    x[: len(g)] = g
    return x


# ---- layout -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n,p,want", [(0, 1, 0), (1, 1, 8), (8, 1, 8), (9, 1, 16), (16, 2, 16),
                                      (17, 2, 32), (100, 3, 120), (24, 3, 24), (1, 4, 32)])
def test_padded_size(n, p, want):
    assert compressed.padded_size(n, p) == want
    lay = Layout(n, p)
    assert lay.padded == want and lay.chunk * p == want and lay.chunk_bytes * 8 == lay.chunk
    assert lay.row_bytes == HEADER_BYTES + want // (8 * p)


@pytest.mark.parametrize("n,p", [(-1, 2), (10, 0)])
def test_padded_size_rejects(n, p):
    with pytest.raises(ValueError, match="got"):
        compressed.padded_size(n, p)


def test_wire_bytes_ratio():
    n = 16 << 20
    for p in (2, 4, 8):
        ratio = fp32_allreduce_wire_bytes(n, p) / Layout(n, p).wire_bytes()
        assert 31.9 < ratio <= 32.0


# ---- host kernels -----------------------------------------------------------------------------
@pytest.mark.parametrize("m,p", [(1, 1), (13, 2), (64, 2), (100, 3), (999, 4), (4096, 4)])
def test_encode_and_residual(impl, m, p):
    rng = np.random.default_rng(m * 10 + p)
    N = compressed.padded_size(m, p)
    g = rng.standard_normal(m).astype(np.float32)
    e = (rng.standard_normal(N) * 0.3).astype(np.float32)
    g[:3] = [-0.0, 0.0, -0.0][: min(3, m)]
    e[:3] = [-0.0, -0.0, 0.0]
    e_before = e.copy()
    msg = np.full((p, HEADER_BYTES + N // (8 * p)), 0xAB, np.uint8)
    ssq = K.encode(g, e, msg[:, HEADER_BYTES:])
    x = padded(g, N) + e_before
    assert np.array_equal(msg[:, HEADER_BYTES:].reshape(-1), ref_bits(x))
    assert np.all(msg[:, :HEADER_BYTES] == 0xAB), "encode wrote into the headers"
    assert np.array_equal(e, e_before), "encode modified the worker error"
    assert ssq == pytest.approx(float(np.dot(x, x)), rel=1e-5)
    scale = 0.37
    K.worker_residual(g, e, scale)
    np.testing.assert_allclose(e, x - scale * ref_sign(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("p,cb", [(1, 1), (2, 5), (3, 17), (4, 64)])
def test_server_steps(impl, p, cb):
    rng = np.random.default_rng(p * 100 + cb)
    msg = rng.integers(0, 256, (p, HEADER_BYTES + cb), dtype=np.uint8)
    rows = msg[:, HEADER_BYTES:]
    coef = rng.uniform(0.1, 2.0, p).astype(np.float32)
    se = (rng.standard_normal(cb * 8) * 0.5).astype(np.float32)
    se0 = se.astype(np.float64)
    out = np.zeros(cb, np.uint8)
    ssq = K.server_accumulate(rows, coef, se, out)
    signs = np.unpackbits(rows, axis=1).astype(np.float64) * 2 - 1
    s = (signs * coef.astype(np.float64)[:, None]).sum(axis=0) + se0
    np.testing.assert_allclose(se, s, rtol=1e-6, atol=1e-6)
    assert np.array_equal(out, ref_bits(s))
    assert ssq == pytest.approx(float(np.dot(s, s)), rel=1e-5)
    K.server_residual(se, 0.8)
    np.testing.assert_allclose(se, s - 0.8 * ref_sign(s), atol=1e-5)


@pytest.mark.parametrize("p,cb,m", [(1, 1, 1), (2, 3, 48), (2, 3, 41), (3, 4, 70), (4, 2, 1)])
def test_decode(impl, p, cb, m):
    rng = np.random.default_rng(m)
    msg = rng.integers(0, 256, (p, HEADER_BYTES + cb), dtype=np.uint8)
    scales = rng.uniform(0.5, 3.0, p).astype(np.float32)
    out = np.full(m + 5, 123.0, np.float32)
    K.decode(msg[:, HEADER_BYTES:], scales, out[:m])
    bits = np.unpackbits(msg[:, HEADER_BYTES:], axis=1).astype(np.float64) * 2 - 1
    want = (bits * scales.astype(np.float64)[:, None]).reshape(-1)[:m]
    np.testing.assert_array_equal(out[:m], want.astype(np.float32))
    assert np.all(out[m:] == 123.0), "decode wrote past the output's end"


def test_default_implementation_is_known():
    assert K.implementation() in ("numba", "numpy")
    with pytest.raises(ValueError, match="expected 'numba' or 'numpy'"):
        K.use("fortran")


# ---- torch kernels ----------------------------------------------------------------------------
def test_torch_pack_and_signs():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(8 * 37).astype(np.float32)
    x[:4] = [0.0, -0.0, -1e-30, 1e-30]
    packed = TK.pack(torch.from_numpy(x))
    assert packed.dtype == torch.uint8
    assert np.array_equal(packed.numpy(), ref_bits(x.astype(np.float64)))
    s = TK.signs(packed).reshape(-1).numpy()
    assert np.array_equal(s, ref_sign(x.astype(np.float64)).astype(np.float32))


def test_falls_back_to_numpy_without_numba():
    import subprocess
    import sys

    code = ("import sys; sys.modules['numba'] = None\n"
            "import numpy as np\n"
            "from compressed import kernels as K\n"
            "assert K.use() == 'numpy', K.implementation()\n"
            "rows = np.zeros((1, 2), np.uint8)\n"
            "K.encode(np.ones(16, np.float32), np.zeros(16, np.float32), rows)\n"
            "assert rows.tolist() == [[255, 255]], rows\n"
            "print('ok')\n")
    env = dict(__import__("os").environ)
    env.pop("MPICOMM_COMPRESSED_KERNELS", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# ---- deferred error updates (OnebitAllreduce's fused pass) ------------------------------------
def ref_correct(e: np.ndarray, pending: float) -> np.ndarray:
    """e - pending * sign(e) in float32 (the error update DeepSpeed applies after each call)."""
    e = e.astype(np.float32)
    return (e - np.float32(pending) * ref_sign(e).astype(np.float32)).astype(np.float32)


@pytest.mark.parametrize("m,p", [(1, 1), (13, 2), (100, 3), (4096, 4), (4096 * 3 + 5, 2)])
@pytest.mark.parametrize("pending", [0.0, 0.37])
def test_encode_into_fuses_the_pending_update(impl, m, p, pending):
    rng = np.random.default_rng(m * 7 + p)
    N = compressed.padded_size(m, p)
    g = rng.standard_normal(m).astype(np.float32)
    e = (rng.standard_normal(N) * 0.3).astype(np.float32)
    e[:2] = [-0.0, 0.0]
    e_before = e.copy()
    xout = np.full(N, 7.0, np.float32)
    msg = np.full((p, HEADER_BYTES + N // (8 * p)), 0xAB, np.uint8)
    ssq = K.encode_into(g, e, pending, xout, msg[:, HEADER_BYTES:])
    c = ref_correct(e_before, pending)
    want = c.copy()
    want[:m] = (g + c[:m]).astype(np.float32)
    np.testing.assert_array_equal(xout, want)
    assert np.array_equal(e, e_before), "encode_into modified its input error"
    assert np.array_equal(msg[:, HEADER_BYTES:].reshape(-1), ref_bits(want.astype(np.float64)))
    assert np.all(msg[:, :HEADER_BYTES] == 0xAB)
    assert ssq == pytest.approx(float(np.dot(want.astype(np.float64), want)), rel=1e-5)
    # in place (xout is e) gives the same
    ssq2 = K.encode_into(g, e, pending, e, msg[:, HEADER_BYTES:])
    np.testing.assert_array_equal(e, want)
    assert ssq2 == pytest.approx(float(np.dot(want.astype(np.float64), want)), rel=1e-5)


@pytest.mark.parametrize("p,cb", [(1, 1), (2, 5), (3, 17), (4, 64)])
def test_server_accumulate_applies_pending_update(impl, p, cb):
    rng = np.random.default_rng(p * 31 + cb)
    rows = rng.integers(0, 256, (p, cb), dtype=np.uint8)
    coef = rng.uniform(0.1, 2.0, p).astype(np.float32)
    se = (rng.standard_normal(cb * 8) * 0.5).astype(np.float32)
    c = ref_correct(se, 0.6).astype(np.float64)
    out = np.zeros(cb, np.uint8)
    ssq = K.server_accumulate(rows, coef, se, out, 0.6)
    signs = np.unpackbits(rows, axis=1).astype(np.float64) * 2 - 1
    s = (signs * coef.astype(np.float64)[:, None]).sum(axis=0) + c
    np.testing.assert_allclose(se, s, rtol=1e-6, atol=1e-6)
    assert np.array_equal(out, ref_bits(s))
    assert ssq == pytest.approx(float(np.dot(s, s)), rel=1e-5)
    K.correct(se, 0.25)
    np.testing.assert_allclose(se, s - 0.25 * ref_sign(s), atol=1e-5)


@pytest.mark.parametrize("offset", [0, 1, 4])
def test_encode_into_same_result_for_any_alignment(impl, offset):
    """The numba kernel streams x with non-temporal stores into 64-byte aligned buffers only;
    aligned or not, x, signs and sum are the same."""
    m, p = 4096 * 4 + 77, 2
    N = compressed.padded_size(m, p)
    rng = np.random.default_rng(offset)
    g = rng.standard_normal(m).astype(np.float32)
    e = (rng.standard_normal(N) * 0.3).astype(np.float32)
    base = torch.zeros(N + 16).numpy()  # torch memory is 64-byte aligned
    xout = base[offset:offset + N]
    rows = np.zeros((p, N // (8 * p)), np.uint8)
    ssq = K.encode_into(g, e, 0.21, xout, rows)
    c = ref_correct(e, 0.21)
    want = c.copy()
    want[:m] = (g + c[:m]).astype(np.float32)
    np.testing.assert_array_equal(xout, want)
    assert np.array_equal(rows.reshape(-1), ref_bits(want.astype(np.float64)))
    assert ssq == pytest.approx(float(np.dot(want.astype(np.float64), want)), rel=1e-5)


@pytest.mark.parametrize("offset", [0, 1, 2, 4])
@pytest.mark.parametrize("m", [8 * 96, 8 * 96 - 3])
def test_decode_same_result_for_any_alignment(impl, offset, m):
    """The numba decode streams into 16-byte aligned outputs and stores plainly otherwise."""
    p, cb = 3, 32
    rng = np.random.default_rng(m + offset)
    rows = rng.integers(0, 256, (p, cb), dtype=np.uint8)
    scales = rng.uniform(0.5, 3.0, p).astype(np.float32)
    base = np.full(m + 8, 5.0, np.float32)
    out = base[offset:offset + m]
    K.decode(rows, scales, out)
    bits = np.unpackbits(rows, axis=1).astype(np.float64) * 2 - 1
    want = (bits * scales.astype(np.float64)[:, None]).reshape(-1)[:m]
    np.testing.assert_array_equal(out, want.astype(np.float32))
    assert np.all(base[:offset] == 5.0) and np.all(base[offset + m:] == 5.0)
