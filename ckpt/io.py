"""Move planned byte ranges between local tensors and one file: each rank on its own with
O_DIRECT (``direct_io``) or plain POSIX calls (``posix_io``), or with collective MPI-IO.

Which one (``io_method``): by default O_DIRECT where every rank's file system takes it, else
collective MPI-IO; under ULFM (a fault-tolerant communicator: Open MPI documents MPI-IO as not
fault tolerant) never MPI-IO: each rank uses O_DIRECT where its file system takes it, else plain
POSIX calls, and no collective call at all. ``MPICOMM_CKPT_IO`` overrides: ``posix`` (per-rank
I/O everywhere), ``buffered`` (per-rank POSIX calls through the page cache, no O_DIRECT) or
``mpiio`` (MPI-IO, no O_DIRECT; refused under ULFM). Every path writes the same file, so a
checkpoint written by one reads with any other."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import torch
from mpi4py import MPI

from mpicomm.faults import fault_tolerant, is_failure, surface

from . import direct_io, posix_io
from .checksum import Piece, crc32
from .byte_ranges import IOItem, batches, chunk, coalesce

DEFAULT_CHUNK_BYTES = 32 << 20   # bound of staging buffers (dtype conversion, device copies)
DIRECT_CHUNK_BYTES = 256 << 20   # rounds that move bytes straight to or from a host tensor
IO_VAR = "MPICOMM_CKPT_IO"
IO_METHODS = ("auto", "posix", "buffered", "mpiio")


def io_method(comm: Any = None) -> str:
    """How ckpt moves data on ``comm`` (an mpicomm Communicator or an mpi4py communicator):
    "posix" or "buffered" (each rank on its own with plain POSIX calls through the page cache:
    O_DIRECT needs every rank to take it, since two ranks' unaligned ends share a disk block,
    and agreeing on that is a collective call), "mpiio" (collective
    MPI-IO, no O_DIRECT) or "auto" (O_DIRECT where every rank can, else MPI-IO). Under ULFM
    "auto" is "posix" and "mpiio" is refused (ValueError)."""
    asked = os.environ.get(IO_VAR, "auto").strip().lower() or "auto"
    if asked not in IO_METHODS:
        raise ValueError(f"{IO_VAR}={os.environ[IO_VAR]!r}: expected one of {', '.join(IO_METHODS)}")
    ft = getattr(comm, "fault_tolerant", None)
    if ft is None:
        ft = fault_tolerant()
    if not ft:
        return asked
    if asked == "buffered":
        return asked
    if asked == "mpiio":
        raise ValueError(f"{IO_VAR}=mpiio under ULFM (mpirun --with-ft ulfm): Open MPI's MPI-IO is not fault "
                         "tolerant, so ckpt writes and reads each rank's bytes with POSIX calls there; "
                         f"unset {IO_VAR} or set it to auto, posix or buffered")
    return "posix"


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor (no copy)."""
    t = t.detach()
    if not t.is_contiguous():
        raise ValueError(f"expected a contiguous tensor, got strides {t.stride()} for shape {tuple(t.shape)}")
    return t.reshape(-1).view(torch.uint8)


def _host(t: torch.Tensor) -> np.ndarray:
    return (t if t.device.type == "cpu" else t.cpu()).numpy()


def _mpi(comm: Any) -> MPI.Comm:
    return getattr(comm, "mpi_comm", comm)


def _rounds(comm: Any, n: int) -> int:
    try:
        return _mpi(comm).allreduce(n, op=MPI.MAX)
    except MPI.Exception as exc:
        err = surface(exc, comm, "ckpt I/O (rounds)")
        if err is exc:
            raise
        raise err from exc


def _open(comm: Any, filename: str, mode: int, info=MPI.INFO_NULL) -> MPI.File:
    try:
        return MPI.File.Open(_mpi(comm), filename, mode, info)
    except MPI.Exception as exc:
        err = surface(exc, comm, f"ckpt I/O (opening {filename})")
        if err is exc:
            raise
        raise err from exc


def _chunks(items: Sequence[IOItem], direct: set[int], chunk_bytes: int, block_size: int,
            itemsize: dict[int, int] | None = None) -> list[IOItem]:
    """Rounds of I/O: large ones for buffers moved in place, ``chunk_bytes`` ones through staging."""
    big = max(chunk_bytes, DIRECT_CHUNK_BYTES // block_size * block_size)
    out = chunk([i for i in items if i.buf in direct], big, block_size, itemsize)
    out += chunk([i for i in items if i.buf not in direct], chunk_bytes, block_size, itemsize)
    return sorted(out, key=lambda c: c.offset)


def _view_type(batch: Sequence[IOItem]):
    """A file view that exposes exactly the batch's byte ranges, in order."""
    if not batch:
        return None
    t = MPI.BYTE.Create_hindexed([c.nbytes for c in batch], [c.offset for c in batch])
    t.Commit()
    return t


def _round(fh: MPI.File, batch: Sequence[IOItem], mem: np.ndarray, call) -> None:
    """One collective call: a single range at its offset, several through a file view."""
    ftype = _view_type(batch)
    fh.Set_view(0, MPI.BYTE, ftype if ftype is not None else MPI.BYTE)
    try:
        call(fh, 0, mem)
    finally:
        if ftype is not None:
            ftype.Free()


def _write_hints() -> MPI.Info:
    """ROMIO: write the pieces of a file view as they are, never by reading and rewriting the
    span between them (data sieving); other MPI-IO implementations ignore the hint."""
    info = MPI.Info.Create()
    info.Set("romio_ds_write", "disable")
    return info


def _plan(items: Sequence[IOItem], direct: set[int], chunk_bytes: int, block_size: int,
          itemsize: dict[int, int] | None = None) -> list[list[IOItem]]:
    chunks = _chunks(coalesce(items), direct, chunk_bytes, block_size, itemsize)
    # ranges moved in place that are big enough get a round each, first; the rest share staging
    # rounds after them. Every rank's round i is then of the same kind: interleaving a rank's big
    # and small rounds in file order would pair one rank's big write with another's small one in
    # each collective call, and the ranks would take turns instead of writing together.
    def alone(c: IOItem) -> bool:
        return c.buf in direct and c.nbytes >= min(chunk_bytes, 1 << 20)

    return [[c] for c in chunks if alone(c)] + batches([c for c in chunks if not alone(c)], lambda c: False,
                                                       chunk_bytes)


def _close(fh: MPI.File, failed: BaseException | None) -> None:
    """Close ``fh`` (collective); after a rank failure, as far as MPI still can."""
    try:
        fh.Close()
    except MPI.Exception:
        if failed is None:
            raise


def _raise_first(failed: BaseException | None, error: BaseException | None, comm: Any,
                 what: str) -> None:
    """Raise what a loop of collective rounds ended with: a rank failure (``surface``: a
    RankFailedError) before a local error, nothing when neither happened."""
    if failed is not None:
        raise surface(failed, comm, what) from error
    if error is not None:
        raise error


def _all_direct(comm: Any, opened: tuple[int, int] | None) -> int:
    """The alignment every rank takes when every rank opened the file with O_DIRECT (``opened``:
    its descriptor and alignment), the largest of theirs; else 0, ``opened``'s descriptor closed."""
    refused = 2 * direct_io.MAX_ALIGN
    align = _rounds(comm, refused if opened is None else opened[1])  # collective: MPI-IO unless every rank can
    if align >= refused:
        if opened is not None:
            os.close(opened[0])
        return 0
    return align


def _method(comm: Any, direct_io_ok: bool) -> tuple[str, bool]:
    """("posix", "mpiio" or "auto"; whether O_DIRECT may be tried) from ``io_method``."""
    method = io_method(comm)
    if method == "buffered":
        return "posix", False
    return method, direct_io_ok and method == "auto"


def _direct(comm: Any, method: str, opened: tuple[int, int] | None) -> int:
    """The O_DIRECT alignment this rank writes or reads with, 0 for none: per rank with
    "posix" (no collective call), else only where every rank can (``_all_direct``)."""
    if method == "posix":
        return 0 if opened is None else opened[1]
    return _all_direct(comm, opened)


def write_items(comm: Any, filename: str, items: Sequence[IOItem],
                buffers: Sequence[torch.Tensor], *, file_size: int, block_size: int,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES, sync: bool = True, direct_io_ok: bool = True) -> list[Piece]:
    """Create ``filename`` of ``file_size`` bytes and write this rank's items from ``buffers``
    (their raw bytes), on every rank of ``comm`` (an mpicomm Communicator or an mpi4py
    communicator); return the CRC of every written piece within each block.

    With ``direct_io_ok`` and where the file system takes O_DIRECT (every rank's, unless
    ``io_method`` says "posix"), each rank writes its ranges on its own, past the page cache
    (``direct_io``), in staged chunks of ``chunk_bytes``. Else, with "posix", each rank writes
    them on its own through the page cache (``posix_io``), straight from host memory. Else MPI-IO: large host ranges are written in place, one collective call each; small or
    device ranges are packed into a staging buffer of at most ``chunk_bytes`` and written
    through a file view. Checksums run in a thread alongside the writes; with ``sync`` the kernel
    is asked to start writing each round back as soon as it is written, and the file is synced
    at the end."""
    method, direct_io_ok = _method(comm, direct_io_ok)
    mpi_comm = _mpi(comm)
    opened = direct_io.open_direct(filename, True) if direct_io_ok else None
    align = _direct(comm, method, opened)
    if align:
        chunks = chunk(coalesce(items), chunk_bytes, block_size)
        return direct_io.write(filename, opened[0], chunks, [byte_view(b) for b in buffers], file_size=file_size,
                               block_size=block_size, staging_bytes=chunk_bytes, sync=sync, host=_host, align=align)
    host = {i for i, b in enumerate(buffers) if b.device.type == "cpu"}
    views = [byte_view(b) for b in buffers]
    if method == "posix":
        return posix_io.write(filename, _chunks(coalesce(items), host, chunk_bytes, block_size), views,
                              file_size=file_size, block_size=block_size, sync=sync, host=_host)
    rounds = _plan(items, host, chunk_bytes, block_size)
    nrounds = _rounds(comm, len(rounds))
    empty = np.empty(0, np.uint8)
    staging: torch.Tensor | None = None
    futures = []
    error: BaseException | None = None  # after a local failure: keep joining the collective calls, empty
    pieces: list[Piece] = []
    failed: BaseException | None = None  # a rank failure (ULFM): raised as RankFailedError
    write = MPI.File.Write_at_all
    info = _write_hints()
    try:
        fh = _open(comm, filename, MPI.MODE_WRONLY | MPI.MODE_CREATE, info)
    finally:
        info.Free()
    fd = None
    try:
        fh.Set_size(file_size)
        if sync and rounds and posix_io.SYNC_FILE_RANGE is not None:
            fd = os.open(filename, os.O_WRONLY)
        with ThreadPoolExecutor(max_workers=1) as pool:
            for i in range(nrounds):
                batch = rounds[i] if i < len(rounds) and error is None else []
                try:
                    srcs = [_host(views[c.buf][c.buf_offset:c.buf_offset + c.nbytes]) for c in batch]
                    for c, src in zip(batch, srcs):
                        futures.append(pool.submit(posix_io.crc_pieces, c.offset, src, block_size))
                    if len(batch) <= 1:
                        mem = srcs[0] if srcs else empty
                    else:
                        total = sum(c.nbytes for c in batch)
                        if staging is None or staging.numel() < total:
                            staging = torch.empty(max(total, min(chunk_bytes, 1 << 20)), dtype=torch.uint8)
                        mem = staging[:total].numpy()
                        pos = 0
                        for src in srcs:
                            mem[pos:pos + len(src)] = src
                            pos += len(src)
                except Exception as exc:  # noqa: BLE001 - raised after the collective calls below
                    error, batch, mem = exc, [], empty
                try:
                    _round(fh, batch, mem, write)
                except Exception as exc:  # noqa: BLE001
                    error = error or exc
                    if is_failure(exc, mpi_comm):  # a rank died: no later collective call completes
                        failed = exc
                        break
                if batch and error is None:
                    posix_io.start_writeback(fd, batch[0].offset, batch[-1].offset + batch[-1].nbytes - batch[0].offset)
            try:
                pieces = [p for f in futures for p in f.result()]
            except Exception as exc:  # noqa: BLE001
                error = error or exc
        if sync and failed is None:
            fh.Sync()
    except MPI.Exception as exc:
        failed = failed or (exc if is_failure(exc, mpi_comm) else None)
        if failed is None:
            raise
    finally:
        if fd is not None:
            os.close(fd)
        _close(fh, failed)
    _raise_first(failed, error, comm, "ckpt write")
    return pieces


def read_items(comm: Any, filename: str, items: Sequence[IOItem],
               dests: Sequence[torch.Tensor], file_dtypes: Sequence[torch.dtype], *,
               block_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES, unchecked: set[int] = frozenset(),
               direct_io_ok: bool = True) -> list[Piece]:
    """Read this rank's items into ``dests``, on every rank of ``comm`` (flat views, converting from
    ``file_dtypes`` where they differ); return the CRC of every piece read within each block,
    except those read into the dests numbered in ``unchecked`` (bytes another rank reports).

    With ``direct_io_ok`` and where the file system takes O_DIRECT (every rank's, unless
    ``io_method`` says "posix"), each rank reads its ranges on its own, past the page cache
    (``direct_io``), in staged chunks of ``chunk_bytes``. Else, with "posix", each rank reads
    them on its own through the page cache (``posix_io``), large ranges in place. Else MPI-IO: large ranges land in place, one collective call each (their
    checksums computed in a thread while the next round is read); small, converted or device
    ranges go through a file view into a staging buffer of at most ``chunk_bytes``."""
    direct = [d.dtype == fd and d.device.type == "cpu" and d.is_contiguous()
              for d, fd in zip(dests, file_dtypes)]
    itemsize = {i: torch.empty(0, dtype=fd).element_size() for i, fd in enumerate(file_dtypes)}
    method, direct_io_ok = _method(comm, direct_io_ok)
    mpi_comm = _mpi(comm)
    opened = direct_io.open_direct(filename, False) if direct_io_ok else None
    align = _direct(comm, method, opened)
    if align:
        chunks = chunk(coalesce(items), chunk_bytes, block_size, itemsize)
        views = [byte_view(d) if ok else None for d, ok in zip(dests, direct)]
        return direct_io.read(opened[0], chunks, dests, views, file_dtypes, itemsize, block_size=block_size,
                              staging_bytes=chunk_bytes, unchecked=set(unchecked), align=align)
    in_place = {i for i, ok in enumerate(direct) if ok}
    views = [byte_view(d) if ok else None for d, ok in zip(dests, direct)]
    if method == "posix":
        return posix_io.read(filename, _chunks(coalesce(items), in_place, chunk_bytes, block_size, itemsize), dests,
                             views, file_dtypes, itemsize, block_size=block_size, staging_bytes=chunk_bytes,
                             unchecked=set(unchecked))
    rounds = _plan(items, in_place, chunk_bytes, block_size, itemsize)
    nrounds = _rounds(comm, len(rounds))
    staging: torch.Tensor | None = None
    empty = np.empty(0, np.uint8)
    futures = []
    error: BaseException | None = None  # after a local failure: keep joining the collective calls, empty
    pieces: list[Piece] = []
    failed: BaseException | None = None  # a rank failure (ULFM): raised as RankFailedError
    read = MPI.File.Read_at_all
    fh = _open(comm, filename, MPI.MODE_RDONLY)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            for i in range(nrounds):
                batch = rounds[i] if i < len(rounds) and error is None else []
                mem, raw = empty, None
                try:
                    if len(batch) == 1 and views[batch[0].buf] is not None:
                        c = batch[0]
                        mem = views[c.buf][c.buf_offset:c.buf_offset + c.nbytes].numpy()
                    else:
                        total = sum(c.nbytes for c in batch)
                        if total and (staging is None or staging.numel() < total):
                            staging = torch.empty(max(total, min(chunk_bytes, 1 << 20)), dtype=torch.uint8)
                        raw = staging[:total] if total else None
                        mem = raw.numpy() if raw is not None else empty
                except Exception as exc:  # noqa: BLE001 - raised after the collective calls
                    error, batch, mem, raw = exc, [], empty, None
                try:
                    _round(fh, batch, mem, read)  # every rank joins every round, failed or not
                except Exception as exc:  # noqa: BLE001
                    error = error or exc
                    if is_failure(exc, mpi_comm):  # a rank died: no later collective call completes
                        failed = exc
                        break
                if error is not None or not batch:
                    continue
                try:
                    if raw is None:
                        if batch[0].buf not in unchecked:
                            futures.append(pool.submit(posix_io.crc_pieces, batch[0].offset, mem, block_size))
                        continue
                    pos = 0
                    for c in batch:
                        part = raw[pos:pos + c.nbytes]
                        if c.buf not in unchecked:
                            futures.append(_Done(posix_io.crc_pieces(c.offset, part.numpy(), block_size)))
                        if views[c.buf] is not None:
                            views[c.buf][c.buf_offset:c.buf_offset + c.nbytes].copy_(part)
                        else:
                            e0, n = c.buf_offset // itemsize[c.buf], c.nbytes // itemsize[c.buf]
                            if pos % itemsize[c.buf]:
                                part = part.clone()  # torch views a dtype only at aligned offsets
                            dests[c.buf].view(-1)[e0:e0 + n].copy_(part.view(file_dtypes[c.buf]))
                        pos += c.nbytes
                except Exception as exc:  # noqa: BLE001
                    error = error or exc
            try:
                pieces = [p for f in futures for p in f.result()]
            except Exception as exc:  # noqa: BLE001
                error = error or exc
    finally:
        _close(fh, failed)
    _raise_first(failed, error, comm, "ckpt read")
    return pieces


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def read_blocks(filename: str, blocks: Sequence[int], block_size: int, file_size: int) -> list[int]:
    """CRC of whole blocks read with plain (non-MPI) I/O, one block at a time."""
    out = []
    with open(filename, "rb", buffering=0) as f:
        for b in blocks:
            f.seek(b * block_size)
            data = f.read(min(block_size, file_size - b * block_size))
            out.append(crc32(data))
    return out


def fsync_path(path: str, directory: bool = False) -> None:
    """fsync a file or a directory entry."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
