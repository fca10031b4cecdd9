"""ckpt's per-rank POSIX path (``ckpt.posix_io``, the one ULFM jobs take where O_DIRECT is
refused) writes the file the MPI-IO and O_DIRECT paths write: bytes and CRC pieces against a
numpy reference, each path reading the others' files, and whole checkpoints saved one way and
loaded the other, against values held apart from the code under test. Also: the POSIX path
never opens an MPI file, ``MPICOMM_CKPT_IO`` is checked, and a freed communicator's async-save
slot is given back."""
from __future__ import annotations

import gc
import zlib

import numpy as np
import pytest
import torch
from mpi4py import MPI
from mpitest import check_all

import ckpt
from ckpt import async_save, checksum, direct_io
from ckpt import io as ckpt_io
from ckpt.byte_ranges import IOItem
from ckpt.io import read_items, write_items

BLOCK = 1 << 16
# (MPICOMM_CKPT_IO, direct_io_ok): per-rank POSIX through the page cache (asked two ways),
# collective MPI-IO, and the default (O_DIRECT where the file system takes it, else MPI-IO)
PATHS = {"posix": ("posix", False), "buffered": ("buffered", True), "mpiio": ("mpiio", False),
         "auto": ("auto", True)}


def _layout(size: int, nranks: int, seed: int) -> list[list[tuple[int, int]]]:
    """Random cuts of [0, size) dealt round-robin: neighbouring ranges of different ranks share blocks."""
    rng = np.random.default_rng(seed)
    cuts = np.unique(np.concatenate([[0, size], rng.integers(1, size, 40)]))
    out: list[list[tuple[int, int]]] = [[] for _ in range(nranks)]
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        out[i % nranks].append((int(a), int(b - a)))
    return out


@pytest.fixture
def file_opens(monkeypatch):
    """Every MPI.File.Open call that ckpt makes during the test (the file names)."""
    from file_spy import spy_file_opens

    return spy_file_opens(monkeypatch.setattr)


def _use(monkeypatch, path: str) -> bool:
    method, direct = PATHS[path]
    monkeypatch.setenv(ckpt_io.IO_VAR, method)
    return direct


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("writer,reader", [("posix", "mpiio"), ("mpiio", "posix"), ("posix", "auto"),
                                           ("auto", "posix"), ("posix", "posix"),
                                           ("buffered", "mpiio"), ("mpiio", "buffered")])
def test_a_file_written_one_way_reads_the_other(world, shared_tmp_path, monkeypatch, file_opens, writer, reader):
    size = 3 * BLOCK + 1234
    ref = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    mine = _layout(size, world.size, 13)[world.rank]
    buf = torch.zeros(sum(n for _, n in mine) + 3, dtype=torch.uint8)  # ranges at odd positions
    items, pos = [], 3
    for off, n in mine:
        buf[pos:pos + n] = torch.from_numpy(ref[off:off + n])
        items.append(IOItem(off, n, 0, pos))
        pos += n
    name = str(shared_tmp_path / "data.bin")
    direct = _use(monkeypatch, writer)
    pieces = write_items(world, name, items, [buf], file_size=size, block_size=BLOCK, chunk_bytes=BLOCK,
                         direct_io_ok=direct)
    parts, counts = checksum.block_parts(pieces, size, BLOCK)
    parts = world.allreduce(parts, op=MPI.BXOR)
    crcs = checksum.blocks_from_parts(parts, world.allreduce(counts), size, BLOCK)
    world.Barrier()
    check_all(lambda: np.testing.assert_array_equal(np.fromfile(name, np.uint8), ref))
    assert crcs == [zlib.crc32(ref[b:b + BLOCK].tobytes()) for b in range(0, size, BLOCK)]
    direct = _use(monkeypatch, reader)
    out = torch.zeros_like(buf)
    pieces = read_items(world, name, items, [out], [torch.uint8], block_size=BLOCK, chunk_bytes=BLOCK,
                        direct_io_ok=direct)
    check_all(lambda: np.testing.assert_array_equal(out[3:].numpy(), buf[3:].numpy()))
    assert sum(p.length for p in pieces) == sum(n for _, n in mine)
    assert all(p.crc == zlib.crc32(ref[p.offset:p.offset + p.length].tobytes()) for p in pieces)
    # float32 file bytes converted into float64 (through the staging buffer)
    f32 = [(off // 4 * 4, n // 4 * 4) for off, n in mine if n >= 8]
    wide = torch.zeros(sum(n for _, n in f32) // 4, dtype=torch.float64)
    conv, e = [], 0
    for off, n in f32:
        conv.append(IOItem(off, n, 0, e * 4))
        e += n // 4
    read_items(world, name, conv, [wide], [torch.float32], block_size=BLOCK, chunk_bytes=BLOCK,
               direct_io_ok=direct, unchecked={0})
    expect = np.concatenate([ref[o:o + n].view(np.float32) for o, n in f32]) if f32 else np.zeros(0)
    np.testing.assert_array_equal(wide.numpy(), expect.astype(np.float64))
    if {writer, reader} <= {"posix", "buffered"}:
        assert file_opens == []  # the POSIX path opened no MPI file


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(37, 29), torch.nn.Tanh(), torch.nn.Linear(29, 7))


def _trained(seed: int):
    net = _model(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for s in range(2):
        opt.zero_grad()
        net(torch.randn(5, 37, generator=torch.Generator().manual_seed(s))).square().mean().backward()
        opt.step()
    return net, opt


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("async_", [False, True])
@pytest.mark.parametrize("writer,reader", [("posix", "mpiio"), ("mpiio", "posix"), ("buffered", "auto")])
def test_a_checkpoint_saved_one_way_loads_the_other(comm, world, shared_tmp_path, monkeypatch, file_opens,
                                                     writer, reader, async_):
    net, opt = _trained(1)
    weights = [p.detach().numpy().copy() for p in net.parameters()]
    moments = [v.numpy().copy() for st in opt.state.values() for _, v in sorted(st.items())]
    extra = torch.nn.Linear(11, 2).double()  # a per-rank item: other values on every rank
    torch.nn.init.constant_(extra.weight, world.rank + 0.5)
    mine = extra.weight.detach().numpy().copy()
    path = shared_tmp_path / "ck"
    _use(monkeypatch, writer)
    out = ckpt.save(path, model=net, optimizer=opt, step=7, comm=comm, state={"mine": ckpt.PerRank(extra)},
                    async_save=async_)
    if async_:
        out.wait()
    opened_by_save = list(file_opens)
    _use(monkeypatch, reader)
    net2, opt2 = _trained(2)  # other values everywhere
    got = torch.nn.Linear(11, 2).double()
    res = ckpt.load(path, model=net2, optimizer=opt2, comm=comm, state={"mine": ckpt.PerRank(got)})
    assert res.step == 7
    for p, w in zip(net2.parameters(), weights):
        np.testing.assert_array_equal(p.detach().numpy(), w)
    for v, m in zip([v for st in opt2.state.values() for _, v in sorted(st.items())], moments):
        np.testing.assert_array_equal(v.numpy(), m)
    np.testing.assert_array_equal(got.weight.detach().numpy(), mine)
    if writer in ("posix", "buffered"):
        assert opened_by_save == []
    else:
        assert len(file_opens) == len(opened_by_save)


@pytest.mark.mpi(min_size=1)
def test_the_io_method_is_checked(comm, world, monkeypatch):
    monkeypatch.setenv(ckpt_io.IO_VAR, "fast")
    with pytest.raises(ValueError, match="MPICOMM_CKPT_IO='fast': expected one of auto, posix, buffered, mpiio"):
        ckpt_io.io_method(comm)
    monkeypatch.setenv(ckpt_io.IO_VAR, "mpiio")
    if comm.fault_tolerant:
        with pytest.raises(ValueError, match="not fault tolerant"):
            ckpt_io.io_method(comm)
    else:
        assert ckpt_io.io_method(comm) == "mpiio"
    monkeypatch.setenv(ckpt_io.IO_VAR, "buffered")
    assert ckpt_io.io_method(comm) == "buffered"
    monkeypatch.delenv(ckpt_io.IO_VAR)
    assert ckpt_io.io_method(comm) == ("posix" if comm.fault_tolerant else "auto")


@pytest.mark.mpi(min_size=1)
def test_a_rank_whose_file_system_refuses_o_direct_still_writes_alone(world, shared_tmp_path, monkeypatch,
                                                                      file_opens):
    """With "posix" each rank picks its own path: rank 0 with O_DIRECT (where the file system
    takes it), the others through the page cache; no collective call, one file."""
    monkeypatch.setenv(ckpt_io.IO_VAR, "posix")
    if world.rank != 0:
        monkeypatch.setattr(direct_io, "open_direct", lambda *a, **k: None)
    monkeypatch.setattr(ckpt_io, "_rounds", lambda *a, **k: pytest.fail("a collective call on the POSIX path"))
    size = 5 * BLOCK + 77
    ref = np.random.default_rng(9).integers(0, 256, size, dtype=np.uint8)
    lo, hi = size * world.rank // world.size, size * (world.rank + 1) // world.size
    buf = torch.from_numpy(ref[lo:hi].copy())
    name = str(shared_tmp_path / "mixed.bin")
    write_items(world, name, [IOItem(lo, hi - lo, 0, 0)], [buf], file_size=size, block_size=BLOCK,
                chunk_bytes=BLOCK)
    world.Barrier()
    check_all(lambda: np.testing.assert_array_equal(np.fromfile(name, np.uint8), ref))
    out = torch.zeros_like(buf)
    read_items(world, name, [IOItem(lo, hi - lo, 0, 0)], [out], [torch.uint8], block_size=BLOCK, chunk_bytes=BLOCK)
    np.testing.assert_array_equal(out.numpy(), ref[lo:hi])
    assert file_opens == []


@pytest.mark.mpi(min_size=1)
def test_a_freed_communicators_save_slot_is_given_back(comm, world, shared_tmp_path):
    sub = comm.dup()
    net = _model(3)
    ckpt.save(shared_tmp_path / "s", model=net, comm=sub, async_save=True).wait()
    slot = async_save._SLOTS[id(sub.mpi_comm)]
    memory = slot.pool.arena.untyped_storage().data_ptr()
    assert slot.pool.arena.numel() > 0 and slot.dup.mpi_comm != MPI.COMM_NULL
    assert async_save.release_dead() == 0  # alive: kept for the next save
    sub.free()
    assert async_save.release_dead() == 1
    assert id(sub.mpi_comm) not in async_save._SLOTS
    assert slot.dup.mpi_comm == MPI.COMM_NULL and slot.pool.arena.numel() == 0
    gc.collect()
    assert not any(_storage_at(o) == memory for o in gc.get_objects())  # the snapshot memory: unreferenced


def _storage_at(obj) -> int | None:
    if not isinstance(obj, torch.Tensor):
        return None
    try:
        return obj.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, fake)
        return None
