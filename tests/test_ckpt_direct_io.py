"""O_DIRECT I/O (ckpt.direct_io) writes and reads the same bytes and CRC pieces as the MPI-IO
path, checked against a numpy reference file, with ranges of every rank sharing disk blocks."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from ckpt import checksum, direct_io
from ckpt.byte_ranges import IOItem
from ckpt.io import read_items, write_items

BLOCK = 1 << 16  # checksum block of the test file


@pytest.mark.parametrize("offset,nbytes", [(0, 8192), (100, 10000), (4096, 100), (4000, 200), (4095, 1),
                                           (8191, 4098), (12288, 4096)])
def test_spans_cover_the_range_with_aligned_whole_blocks(offset, nbytes):
    got = direct_io.spans(offset, nbytes)
    assert got[0][0] == offset and got[-1][1] == offset + nbytes
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))            # contiguous, in order
    for s, e, whole in got:
        assert e > s
        aligned = s % direct_io.ALIGN == 0 and e % direct_io.ALIGN == 0
        assert whole == aligned or (not whole and e - s < direct_io.ALIGN)
    assert sum(w for *_, w in got) <= 1


def test_aligned_buffer_and_staging_reuse():
    buf = direct_io.aligned_buffer(12345)
    assert buf.ctypes.data % direct_io.ALIGN == 0 and len(buf) == 12345
    with direct_io.staging(1 << 20) as a:
        first = a.ctypes.data
    with direct_io.staging(1 << 19) as b:
        assert b.ctypes.data == first and b.ctypes.data % direct_io.ALIGN == 0


def _layout(size: int, nranks: int, seed: int) -> list[list[tuple[int, int]]]:
    """Every rank's file ranges: random cuts of [0, size), dealt round-robin, so that neighbouring
    ranges (of different ranks) share disk blocks."""
    rng = np.random.default_rng(seed)
    cuts = np.unique(np.concatenate([[0, size], rng.integers(1, size, 40)]))
    out: list[list[tuple[int, int]]] = [[] for _ in range(nranks)]
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        out[i % nranks].append((int(a), int(b - a)))
    return out


@pytest.mark.mpi(min_size=1)
def test_direct_and_mpiio_write_and_read_the_same_bytes(world, shared_tmp_path):
    size = 3 * BLOCK + 1234
    ref = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)  # the file every rank writes a part of
    mine = _layout(size, world.size, 11)[world.rank]
    buf = torch.zeros(sum(n for _, n in mine) + 3, dtype=torch.uint8)  # one buffer, ranges at odd positions
    items, pos = [], 3
    for off, n in mine:
        buf[pos:pos + n] = torch.from_numpy(ref[off:off + n])
        items.append(IOItem(off, n, 0, pos))
        pos += n
    _skip_without_direct(world, shared_tmp_path)
    crcs = {}
    for direct in (True, False):
        name = str(shared_tmp_path / f"data-{direct}.bin")
        pieces = write_items(world, name, items, [buf], file_size=size, block_size=BLOCK, chunk_bytes=BLOCK,
                             direct_io_ok=direct)
        parts, counts = checksum.block_parts(pieces, size, BLOCK)
        parts = world.allreduce(parts, op=_bxor())
        crcs[direct] = checksum.blocks_from_parts(parts, world.allreduce(counts), size, BLOCK)
        world.Barrier()
        assert np.array_equal(np.fromfile(name, np.uint8), ref), direct
    want = [zlib.crc32(ref[b:b + BLOCK].tobytes()) for b in range(0, size, BLOCK)]
    assert crcs[True] == crcs[False] == want
    # read back: into a uint8 buffer in place, and float32 file bytes converted into float64
    f32 = [(off // 4 * 4, n // 4 * 4) for off, n in mine if n >= 4]
    for direct in (True, False):
        name = str(shared_tmp_path / f"data-{not direct}.bin")  # each path reads the other's file
        out = torch.zeros_like(buf)
        pieces = read_items(world, name, items, [out], [torch.uint8], block_size=BLOCK, chunk_bytes=BLOCK,
                            direct_io_ok=direct)
        assert torch.equal(out[3:], buf[3:]), direct
        assert sum(p.length for p in pieces) == sum(n for _, n in mine)
        for p in pieces:
            assert p.crc == zlib.crc32(ref[p.offset:p.offset + p.length].tobytes())
        wide = torch.zeros(sum(n for _, n in f32) // 4, dtype=torch.float64)
        conv, e = [], 0
        for off, n in f32:
            conv.append(IOItem(off, n, 0, e * 4))
            e += n // 4
        read_items(world, name, conv, [wide], [torch.float32], block_size=BLOCK, chunk_bytes=BLOCK,
                   direct_io_ok=direct, unchecked={0})
        expect = np.concatenate([ref[o:o + n].view(np.float32) for o, n in f32]) if f32 else np.zeros(0)
        np.testing.assert_array_equal(wide.numpy(), expect.astype(np.float64))


def _skip_without_direct(world, tmp) -> None:
    usable = direct_io.open_direct(str(tmp / f"probe{world.rank}"), True)
    if world.allreduce(int(usable is None)):
        pytest.skip("this file system refuses O_DIRECT")
    direct_io.os.close(usable[0])


def _demanding_fs(monkeypatch, need: int) -> list[tuple[str, int, int]]:
    """Make O_DIRECT calls fail with EINVAL unless offset, length and address are multiples of
    ``need`` (a file system that takes O_DIRECT but asks more than 4 KiB); return the list of the
    direct calls that went through: (call, offset, length)."""
    import errno
    import fcntl
    import os

    done: list[tuple[str, int, int]] = []
    real_pwrite, real_preadv = os.pwrite, os.preadv

    def check(call: str, fd: int, mem, offset: int) -> None:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            arr = np.frombuffer(mem, np.uint8)
            if offset % need or len(arr) % need or arr.ctypes.data % need:
                raise OSError(errno.EINVAL, "Invalid argument")
            done.append((call, offset, len(arr)))

    def pwrite(fd, data, offset):
        check("pwrite", fd, data, offset)
        return real_pwrite(fd, data, offset)

    def preadv(fd, buffers, offset):
        check("preadv", fd, buffers[0], offset)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", pwrite)
    monkeypatch.setattr(direct_io.os, "preadv", preadv)
    return done


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("need", [1 << 16, 4 * (1 << 20)])
def test_a_file_system_that_asks_more_alignment_still_saves_and_loads(world, shared_tmp_path, monkeypatch, need):
    """O_DIRECT accepted at open but EINVAL below ``need`` bytes of alignment: the save and load
    use the alignment the file system takes (64 KiB), or MPI-IO when none up to MAX_ALIGN (1 MiB)
    is taken; the bytes and CRC pieces are the reference's either way."""
    _skip_without_direct(world, shared_tmp_path)
    size = 3 * BLOCK * world.size + 1234  # every rank's range holds whole 64 KiB blocks
    ref = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    cuts = [0, *(size * r // world.size + 17 for r in range(1, world.size)), size]  # unaligned, large ranges
    off, n = cuts[world.rank], cuts[world.rank + 1] - cuts[world.rank]
    buf = torch.from_numpy(ref[off:off + n].copy())
    items = [IOItem(off, n, 0, 0)]
    done = _demanding_fs(monkeypatch, need)
    name = str(shared_tmp_path / f"demanding-{need}.bin")
    pieces = write_items(world, name, items, [buf], file_size=size, block_size=BLOCK, chunk_bytes=4 * BLOCK)
    world.Barrier()
    assert np.array_equal(np.fromfile(name, np.uint8), ref)
    assert all(p.crc == zlib.crc32(ref[p.offset:p.offset + p.length].tobytes()) for p in pieces)
    assert sum(p.length for p in pieces) == n
    direct_writes = [d for d in done if d[0] == "pwrite" and d[2] > 0]
    out = torch.zeros_like(buf)
    pieces = read_items(world, name, items, [out], [torch.uint8], block_size=BLOCK, chunk_bytes=4 * BLOCK)
    assert torch.equal(out, buf)
    assert all(p.crc == zlib.crc32(ref[p.offset:p.offset + p.length].tobytes()) for p in pieces)
    if need > 1 << 20:
        assert done == []  # every alignment refused: MPI-IO wrote and read it all
    else:
        assert len(direct_writes) >= 2  # the probe, then whole 64 KiB blocks of data
        assert any(d[0] == "preadv" for d in done)
        assert all(o % need == 0 and ln % need == 0 for _c, o, ln in done)


def _bxor():
    from mpi4py import MPI

    return MPI.BXOR
