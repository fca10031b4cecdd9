"""Compression kernels and layout against float64 numpy references (single process, no MPI)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import compressed
from compressed import kernels as K
from compressed import torch_kernels as TK
from compressed.wire_format import Layout

pytestmark = pytest.mark.once    # the same on any MPI: CI runs it on MPICH only

HEADER_BYTES = 4  # bytes kept in front of each row: the kernels must work on strided rows

IMPLS = ["numpy"]
try:
    import numba  # noqa: F401
    IMPLS.append("numba")
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(params=IMPLS)
def kern(request):
    """One host kernel implementation (``compressed.kernels.module``)."""
    return K.module(request.param)


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
    pieces = lay.pieces()
    assert pieces[0][0] == 0 and pieces[-1][1] == max(lay.chunk_bytes, 0)
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


def test_pieces_are_bounded(monkeypatch):
    from compressed import wire_format as layout

    monkeypatch.setattr(layout, "PIECE_BYTES", 24)
    monkeypatch.setattr(layout, "MAX_PIECES", 4)
    lay = Layout(1000, 3)  # padded 1008, chunk 336, 42 bytes
    assert lay.pieces() == [(0, 24), (24, 42)]
    assert Layout(1000, 3, max_pieces=1).pieces() == [(0, 42)]
    assert len(Layout(100000, 1).pieces()) == 4  # 12500 bytes: at most 4 pieces


@pytest.mark.parametrize("n,p", [(-1, 2), (10, 0)])
def test_padded_size_rejects(n, p):
    with pytest.raises(ValueError, match="got"):
        compressed.padded_size(n, p)


# ---- host kernels -----------------------------------------------------------------------------
@pytest.mark.parametrize("m,p", [(1, 1), (13, 2), (64, 2), (100, 3), (999, 4), (4096, 4)])
def test_encode_and_residual(kern, m, p):
    rng = np.random.default_rng(m * 10 + p)
    N = compressed.padded_size(m, p)
    g = rng.standard_normal(m).astype(np.float32)
    e = (rng.standard_normal(N) * 0.3).astype(np.float32)
    g[:3] = [-0.0, 0.0, -0.0][: min(3, m)]
    e[:3] = [-0.0, -0.0, 0.0]
    e_before = e.copy()
    msg = np.full((p, HEADER_BYTES + N // (8 * p)), 0xAB, np.uint8)
    ssq = kern.encode(g, e, msg[:, HEADER_BYTES:])
    x = padded(g, N) + e_before
    assert np.array_equal(msg[:, HEADER_BYTES:].reshape(-1), ref_bits(x))
    assert np.all(msg[:, :HEADER_BYTES] == 0xAB), "encode wrote into the headers"
    assert np.array_equal(e, e_before), "encode modified the worker error"
    assert ssq == pytest.approx(float(np.dot(x, x)), rel=1e-5)
    scale = 0.37
    kern.worker_residual(g, e, scale)
    np.testing.assert_allclose(e, x - scale * ref_sign(x), rtol=0, atol=1e-6)


# numba works in blocks of 32 packed bytes: whole blocks, tails, both
@pytest.mark.parametrize("p,cb", [(1, 1), (2, 5), (3, 17), (4, 64), (2, 75), (3, 33)])
def test_server_steps(kern, p, cb):
    rng = np.random.default_rng(p * 100 + cb)
    msg = rng.integers(0, 256, (p, HEADER_BYTES + cb), dtype=np.uint8)
    rows = msg[:, HEADER_BYTES:]
    coef = rng.uniform(0.1, 2.0, p).astype(np.float32)
    se = (rng.standard_normal(cb * 8) * 0.5).astype(np.float32)
    se0 = se.astype(np.float64)
    out = np.zeros(cb, np.uint8)
    ssq = kern.server_accumulate(rows, coef, se, out, 0.0)
    signs = np.unpackbits(rows, axis=1).astype(np.float64) * 2 - 1
    s = (signs * coef.astype(np.float64)[:, None]).sum(axis=0) + se0
    np.testing.assert_allclose(se, s, rtol=1e-6, atol=1e-6)
    assert np.array_equal(out, ref_bits(s))
    assert ssq == pytest.approx(float(np.dot(s, s)), rel=1e-5)
    kern.server_residual(se, 0.8)
    np.testing.assert_allclose(se, s - 0.8 * ref_sign(s), atol=1e-5)


@pytest.mark.parametrize("p,cb,m", [(1, 1, 1), (2, 3, 48), (2, 3, 41), (3, 4, 70), (4, 2, 1)])
def test_decode(kern, p, cb, m):
    rng = np.random.default_rng(m)
    msg = rng.integers(0, 256, (p, HEADER_BYTES + cb), dtype=np.uint8)
    scales = rng.uniform(0.5, 3.0, p).astype(np.float32)
    out = np.full(m + 5, 123.0, np.float32)
    kern.decode(msg[:, HEADER_BYTES:], scales, out[:m])
    bits = np.unpackbits(msg[:, HEADER_BYTES:], axis=1).astype(np.float64) * 2 - 1
    want = (bits * scales.astype(np.float64)[:, None]).reshape(-1)[:m]
    np.testing.assert_array_equal(out[:m], want.astype(np.float32))
    assert np.all(out[m:] == 123.0), "decode wrote past the output's end"


def test_default_implementation_is_known(monkeypatch):
    assert K.implementation_of(K.module()) in ("numba", "numpy")
    with pytest.raises(ValueError, match="expected 'numba' or 'numpy'"):
        K.module("fortran")
    monkeypatch.setenv(K.ENV, "numpy")
    assert K.implementation_of(K.module()) == "numpy"
    with pytest.raises(ValueError, match="kernels: expected one of"):
        compressed.Compressor(kernels="fortran")


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
            "mod = K.module()\n"
            "assert K.implementation_of(mod) == 'numpy', mod\n"
            "rows = np.zeros((1, 2), np.uint8)\n"
            "mod.encode(np.ones(16, np.float32), np.zeros(16, np.float32), rows)\n"
            "assert rows.tolist() == [[255, 255]], rows\n"
            "print('ok')\n")
    # a fresh singleton MPI process: no kernel choice, no launcher variables of this run
    env = {k: v for k, v in __import__("os").environ.items()
           if k != K.ENV and not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_",
                                                "OMPI_"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("m,p", [(1, 1), (13, 2), (100, 3), (4096, 4), (4096 * 3 + 5, 2)])
def test_bf16_kernels_widen_as_torch(kern, m, p):
    """g as bfloat16 bits: the same signs, sum and error as float32 values widened by torch."""
    rng = np.random.default_rng(m * 11 + p)
    N = compressed.padded_size(m, p)
    gb = torch.from_numpy(rng.standard_normal(m).astype(np.float32) * 3).to(torch.bfloat16)
    gb[:4] = torch.tensor([-0.0, 0.0, 1e-40, -2.5])[:min(m, 4)]
    g32 = gb.float().numpy()                      # torch's widening: the reference
    bits = gb.view(torch.int16).numpy().view(np.uint16)
    e = (rng.standard_normal(N) * 0.3).astype(np.float32)
    x = e.astype(np.float64)
    x[:m] += g32
    want_x = x.astype(np.float32)
    rows = np.zeros((p, N // (8 * p)), np.uint8)
    ssq = kern.encode_bf16(bits, e, rows)
    assert np.array_equal(rows.reshape(-1), ref_bits(want_x.astype(np.float64)))
    assert ssq == pytest.approx(float(np.dot(want_x.astype(np.float64), want_x)), rel=1e-5)
    kern.worker_residual_bf16(bits, e, 0.37)
    sign = ref_sign(want_x).astype(np.float32)
    np.testing.assert_array_equal(e, (want_x - np.float32(0.37) * sign).astype(np.float32))


# ---- deferred error updates (OnebitAllreduce's fused pass) ------------------------------------
def ref_correct(e: np.ndarray, pending: float) -> np.ndarray:
    """e - pending * sign(e) in float32 (the error update DeepSpeed applies after each call)."""
    e = e.astype(np.float32)
    return (e - np.float32(pending) * ref_sign(e).astype(np.float32)).astype(np.float32)


@pytest.mark.parametrize("m,p", [(1, 1), (13, 2), (100, 3), (4096, 4), (4096 * 3 + 5, 2)])
@pytest.mark.parametrize("pending", [0.0, 0.37])
def test_encode_into_fuses_the_pending_update(kern, m, p, pending):
    rng = np.random.default_rng(m * 7 + p)
    N = compressed.padded_size(m, p)
    g = rng.standard_normal(m).astype(np.float32)
    e = (rng.standard_normal(N) * 0.3).astype(np.float32)
    e[:2] = [-0.0, 0.0]
    e_before = e.copy()
    xout = np.full(N, 7.0, np.float32)
    msg = np.full((p, HEADER_BYTES + N // (8 * p)), 0xAB, np.uint8)
    ssq = kern.encode_into(g, e, pending, xout, msg[:, HEADER_BYTES:])
    c = ref_correct(e_before, pending)
    want = c.copy()
    want[:m] = (g + c[:m]).astype(np.float32)
    np.testing.assert_array_equal(xout, want)
    assert np.array_equal(e, e_before), "encode_into modified its input error"
    assert np.array_equal(msg[:, HEADER_BYTES:].reshape(-1), ref_bits(want.astype(np.float64)))
    assert np.all(msg[:, :HEADER_BYTES] == 0xAB)
    assert ssq == pytest.approx(float(np.dot(want.astype(np.float64), want)), rel=1e-5)
    # in place (xout is e) gives the same
    ssq2 = kern.encode_into(g, e, pending, e, msg[:, HEADER_BYTES:])
    np.testing.assert_array_equal(e, want)
    assert ssq2 == pytest.approx(float(np.dot(want.astype(np.float64), want)), rel=1e-5)


# numba works in blocks of 32 packed bytes: whole blocks, tails, both
@pytest.mark.parametrize("p,cb", [(1, 1), (2, 5), (3, 17), (4, 64), (2, 75), (3, 33)])
def test_server_accumulate_applies_pending_update(kern, p, cb):
    rng = np.random.default_rng(p * 31 + cb)
    rows = rng.integers(0, 256, (p, cb), dtype=np.uint8)
    coef = rng.uniform(0.1, 2.0, p).astype(np.float32)
    se = (rng.standard_normal(cb * 8) * 0.5).astype(np.float32)
    c = ref_correct(se, 0.6).astype(np.float64)
    out = np.zeros(cb, np.uint8)
    ssq = kern.server_accumulate(rows, coef, se, out, 0.6)
    signs = np.unpackbits(rows, axis=1).astype(np.float64) * 2 - 1
    s = (signs * coef.astype(np.float64)[:, None]).sum(axis=0) + c
    np.testing.assert_allclose(se, s, rtol=1e-6, atol=1e-6)
    assert np.array_equal(out, ref_bits(s))
    assert ssq == pytest.approx(float(np.dot(s, s)), rel=1e-5)
    kern.server_residual(se, 0.25)  # how a deferred update is applied
    np.testing.assert_allclose(se, s - 0.25 * ref_sign(s), atol=1e-5)


@pytest.mark.parametrize("offset", [0, 1, 4])
def test_encode_into_same_result_for_any_alignment(kern, offset):
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
    ssq = kern.encode_into(g, e, 0.21, xout, rows)
    c = ref_correct(e, 0.21)
    want = c.copy()
    want[:m] = (g + c[:m]).astype(np.float32)
    np.testing.assert_array_equal(xout, want)
    assert np.array_equal(rows.reshape(-1), ref_bits(want.astype(np.float64)))
    assert ssq == pytest.approx(float(np.dot(want.astype(np.float64), want)), rel=1e-5)


@pytest.mark.parametrize("offset", [0, 1, 2, 4])
@pytest.mark.parametrize("m", [8 * 96, 8 * 96 - 3])
def test_decode_same_result_for_any_alignment(kern, offset, m):
    """The numba decode streams into 16-byte aligned outputs and stores plainly otherwise."""
    p, cb = 3, 32
    rng = np.random.default_rng(m + offset)
    rows = rng.integers(0, 256, (p, cb), dtype=np.uint8)
    scales = rng.uniform(0.5, 3.0, p).astype(np.float32)
    base = np.full(m + 8, 5.0, np.float32)
    out = base[offset:offset + m]
    kern.decode(rows, scales, out)
    bits = np.unpackbits(rows, axis=1).astype(np.float64) * 2 - 1
    want = (bits * scales.astype(np.float64)[:, None]).reshape(-1)[:m]
    np.testing.assert_array_equal(out, want.astype(np.float32))
    assert np.all(base[:offset] == 5.0) and np.all(base[offset + m:] == 5.0)


@pytest.mark.parametrize("offset", [0, 1, 4])
@pytest.mark.parametrize("alias", [False, True])
def test_add_mean_same_result_for_any_alignment(kern, offset, alias):
    """The numba add_mean streams into 64-byte aligned outputs only; aligned or not, and with
    ``out`` aliasing its first input, it rounds as numpy's float32 add then divide."""
    n = 4096 * 2 + 13
    rng = np.random.default_rng(offset)
    a = rng.standard_normal(n).astype(np.float32) * 7
    b = rng.standard_normal(n).astype(np.float32)
    want = (a + b) / np.float32(3)
    base = torch.full((n + 16,), 5.0).numpy()  # torch memory is 64-byte aligned
    out = base[offset:offset + n]
    if alias:
        out[:] = a
    kern.add_mean(out if alias else a, b, 3, out)
    np.testing.assert_array_equal(out, want)
    assert np.all(base[:offset] == 5.0) and np.all(base[offset + n:] == 5.0)


# ---- kernel families: the same bytes on the wire -----------------------------------------------
@pytest.mark.parametrize("pend", [0.0, 0.3])
def test_families_write_the_same_bytes(pend):
    """Host (each implementation) and torch families produce the same packed signs and sums."""
    from compressed.families import HostFamily, TorchFamily

    rng = np.random.default_rng(11)
    m, p, cb = 1000, 2, 63
    g = rng.standard_normal(m).astype(np.float32)
    e = (rng.standard_normal(8 * p * cb) * 0.3).astype(np.float32)
    x = padded(g, e.size) + np.where(e >= 0, e - pend, e + pend)
    rows_in = rng.integers(0, 256, (p, cb), dtype=np.uint8)
    coef = np.array([0.4, 0.9], np.float32)
    se = (rng.standard_normal(8 * cb) * 0.5).astype(np.float32)
    s = (np.unpackbits(rows_in, axis=1) * 2.0 - 1) * coef[:, None].astype(np.float64)
    s = s.sum(axis=0) + np.where(se >= 0, se - pend, se + pend)
    for fam in [HostFamily(i) for i in IMPLS] + [TorchFamily(torch.device("cpu"))]:
        rows = fam.view(torch.zeros((p, cb), dtype=torch.uint8))
        xout = fam.view(torch.zeros(e.size))
        ssq = fam.encode(fam.view(torch.from_numpy(g)), fam.view(torch.from_numpy(e.copy())), rows,
                         xout, pend)
        assert np.array_equal(np.asarray(rows).reshape(-1), ref_bits(x)), fam.name
        assert ssq == pytest.approx(float(np.dot(x, x)), rel=1e-5)
        np.testing.assert_allclose(np.asarray(xout), x, atol=1e-6)
        out = fam.view(torch.zeros(cb, dtype=torch.uint8))
        sv = fam.view(torch.from_numpy(se.copy()))
        sss = fam.server_accumulate(fam.view(torch.from_numpy(rows_in)), coef, sv, out, pend)
        np.testing.assert_allclose(np.asarray(sv), s, atol=1e-5)
        assert np.array_equal(np.asarray(out), ref_bits(s)) and sss == pytest.approx(float(s @ s), rel=1e-5)
        dec = fam.view(torch.zeros(8 * cb - 5))
        fam.decode(fam.view(torch.from_numpy(rows_in[1:])), coef[1:], dec)
        want = ((np.unpackbits(rows_in[1]) * 2.0 - 1) * coef[1])[:8 * cb - 5]
        np.testing.assert_array_equal(np.asarray(dec), want.astype(np.float32))


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("sub", [1, 4095, 4096 + 7])
def test_node_mean_adds_rows_in_rank_order_and_reads_its_own_row_from_src(parts, sub):
    from compressed.families import HostFamily, TorchFamily

    rng = np.random.default_rng(parts * 10 + sub)
    src = rng.standard_normal(parts * sub).astype(np.float32) * 100
    for j in range(parts):
        recv = rng.standard_normal(parts * sub).astype(np.float32)
        recv[j * sub:(j + 1) * sub] = np.nan  # own row: never read from recv
        rows = [(src if r == j else recv)[r * sub:(r + 1) * sub] for r in range(parts)]
        want = rows[0].copy()
        for row in rows[1:]:  # float32, rank order, then one division: the documented rounding
            want = want + row
        want = want / np.float32(parts)
        for impl in IMPLS:
            out = np.full(sub, -1.0, np.float32)
            HostFamily(impl).node_mean(src, recv, j, parts, out)
            np.testing.assert_array_equal(out, want, err_msg=impl)
        torch_out = torch.full((sub,), -1.0)
        TorchFamily(torch.device("cpu")).node_mean(torch.from_numpy(src), torch.from_numpy(recv),
                                                   j, parts, torch_out)
        np.testing.assert_array_equal(torch_out.numpy(), want)


@pytest.mark.parametrize("m,p", [(8, 1), (4096 + 8 * 3, 2), (4096 * 3 + 5, 2)])
@pytest.mark.parametrize("pending", [0.0, 0.37])
@pytest.mark.parametrize("offset", [0, 1])
def test_encode_mean_into_is_add_mean_then_encode_into(kern, m, p, pending, offset):
    """The fused hierarchical pack rounds the node mean exactly as add_mean does, then packs
    as encode_into does (tiles and tail, streamed or not): the same x, signs and sum."""
    rng = np.random.default_rng(m + offset)
    N = compressed.padded_size(m, p)
    a = rng.standard_normal(m).astype(np.float32) * 5
    b = rng.standard_normal(m).astype(np.float32)
    e = (rng.standard_normal(N) * 0.3).astype(np.float32)
    e_before, a_before = e.copy(), a.copy()
    mean = (a + b) / np.float32(3)  # numpy's float32 add then divide: the documented rounding
    want_x = np.full(N, 7.0, np.float32)
    want_rows = np.zeros((p, N // (8 * p)), np.uint8)
    want_ss = kern.encode_into(mean, e, pending, want_x, want_rows)
    base = torch.full((N + 16,), 7.0).numpy()  # torch memory is 64-byte aligned
    xout = base[offset:offset + N]
    rows = np.zeros_like(want_rows)
    ss = kern.encode_mean_into(a, b, 3, e, pending, xout, rows)
    np.testing.assert_array_equal(xout, want_x)
    assert np.array_equal(rows, want_rows)
    assert ss == pytest.approx(want_ss, rel=1e-6)
    assert np.array_equal(e, e_before) and np.array_equal(a, a_before), "inputs were modified"
    assert np.all(base[:offset] == 7.0) and np.all(base[offset + N:] == 7.0)


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_lazy_node_mean_packs_what_node_mean_then_encode_packs(parts):
    """A NodeMean handed to HostFamily.encode (sliced as the engine's steps slice it) gives the
    bytes, x and sum of writing the node mean out first."""
    from compressed.families import HostFamily, NodeMean

    sub = 4096 * 2 + 64
    rng = np.random.default_rng(parts)
    src = rng.standard_normal(parts * sub).astype(np.float32) * 10
    recv = rng.standard_normal(parts * sub).astype(np.float32)
    e = (rng.standard_normal(sub) * 0.2).astype(np.float32)
    for impl in IMPLS:
        fam = HostFamily(impl)
        for j in range(parts):
            part = np.empty(sub, np.float32)
            fam.node_mean(src, recv, j, parts, part)
            want_x, want_rows = np.empty(sub, np.float32), np.zeros((1, sub // 8), np.uint8)
            want_ss = fam.encode(part, e, want_rows, want_x, 0.05)
            scratch = np.full(sub, np.nan, np.float32)
            recv_j = recv.copy()
            recv_j[j * sub:(j + 1) * sub] = np.nan  # its own row is read from src only
            lazy = fam.lazy_node_mean(src, recv_j, j, parts, scratch)
            assert isinstance(lazy, NodeMean) and lazy.shape == (sub,)
            x, rows, ss = np.empty(sub, np.float32), np.zeros((1, sub // 8), np.uint8), 0.0
            for lo in range(0, sub, 4096):  # in steps, as engine._phase1 cuts its input
                hi = min(lo + 4096, sub)
                ss += fam.encode(lazy[lo:hi], e[lo:hi], rows[:, lo // 8:hi // 8], x[lo:hi], 0.05)
            np.testing.assert_array_equal(x, want_x, err_msg=f"{impl} j={j}")
            assert np.array_equal(rows, want_rows) and ss == pytest.approx(want_ss, rel=1e-6)
        with pytest.raises(TypeError, match="needs x"):
            fam.encode(lazy, e, rows)
