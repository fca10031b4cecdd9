"""Counts beyond MPI's 32-bit range on MPI libraries without large-count calls.

MPI-4 libraries take 64-bit counts (mpi4py 4 calls their ``_c`` variants). On MPI-3 libraries
(Open MPI 5 reports MPI 3.1) an argument above 2^31 - 1 is refused, so the communicator
rewrites such calls: reductions run in pieces of at most :data:`MAX_COUNT` elements, moves
describe each rank's part with one contiguous derived datatype (count 1), and ``alltoallv``
becomes ``alltoallw`` with one placed datatype per peer. Results and error messages do not
change; a non-blocking call returns one request over all its pieces (``requests.Requests``).
"""
from __future__ import annotations

from typing import Callable, Iterator

import mpi4py
from mpi4py import MPI

from .requests import Requests, kept_on_failure

_INT_MAX = 2 ** 31 - 1
_fromaddress = MPI.buffer.fromaddress


def native_large_counts() -> bool:
    """Whether MPI calls take counts and displacements beyond 2^31 - 1 (MPI-4 ``_c`` calls via mpi4py 4)."""
    return MPI.Get_version() >= (4, 0) and int(mpi4py.__version__.split(".")[0]) >= 4


#: The largest count or displacement one MPI call argument takes (tests patch it to force pieces).
MAX_COUNT = (1 << 62) if native_large_counts() else _INT_MAX


def too_big(*counts: int) -> bool:
    """Whether any count or displacement is beyond what one MPI call argument takes."""
    return max(counts, default=0) > MAX_COUNT


def _ranges(count: int) -> Iterator[tuple[int, int]]:
    step = MAX_COUNT
    for start in range(0, count, step):
        yield start, min(step, count - start)


def piece(spec: list, start: int, count: int) -> list:
    """The ``count`` elements from element ``start`` of a [buffer, datatype] spec."""
    buf, mpi_type = spec[0], spec[1]
    extent = mpi_type.Get_extent()[1]
    return [_fromaddress(buf.address + start * extent, count * extent), count, mpi_type]


def in_pieces(blocking: Callable, nonblocking: Callable, count: int,
              args: Callable[[int, int], tuple]) -> tuple[Callable, Callable]:
    """(blocking, nonblocking) callables running one MPI call per piece of ``count`` elements.

    ``args(start, n)`` gives the call's arguments for elements [start, start + n); every rank
    issues the same pieces in the same order, so blocking and non-blocking pieces match up.
    """
    def run_blocking() -> None:
        for start, n in _ranges(count):
            blocking(*args(start, n))

    def run_nonblocking() -> Requests:
        posted: list = []
        with kept_on_failure(posted):
            for start, n in _ranges(count):
                posted.append(nonblocking(*args(start, n)))
        return Requests.together(posted)

    return run_blocking, run_nonblocking


def reduce_scatter_pieces(comm: MPI.Intracomm, send: list, recv: list, per_rank: int,
                          mpi_op) -> tuple[Callable, Callable]:
    """``reduce_scatter_block`` as reduces to each rank in turn, in pieces."""
    size, rank = comm.Get_size(), comm.Get_rank()
    blocks = [(root, start, n) for root in range(size) for start, n in _ranges(per_rank)]

    def args(root, start, n):
        mine = piece(recv, start, n) if root == rank else None
        return piece(send, root * per_rank + start, n), mine, mpi_op, root

    def run_blocking() -> None:
        for block in blocks:
            comm.Reduce(*args(*block))

    def run_nonblocking() -> Requests:
        posted: list = []
        with kept_on_failure(posted):
            for block in blocks:
                posted.append(comm.Ireduce(*args(*block)))
        return Requests.together(posted)

    return run_blocking, run_nonblocking


_TYPES: dict[tuple[int, int], MPI.Datatype] = {}


def contiguous(mpi_type: MPI.Datatype, count: int) -> MPI.Datatype:
    """A committed datatype of ``count`` consecutive ``mpi_type`` elements (cached)."""
    key = (mpi_type.py2f(), count)
    found = _TYPES.get(key)
    if found is None:
        found = _build(mpi_type, count)
        found.Commit()
        _TYPES[key] = found
    return found


def _build(mpi_type: MPI.Datatype, count: int) -> MPI.Datatype:
    if count <= MAX_COUNT:
        return mpi_type.Create_contiguous(count)
    whole, rest = divmod(count, MAX_COUNT)
    block = mpi_type.Create_contiguous(MAX_COUNT)
    blocks = _build(block, whole)
    extent = mpi_type.Get_extent()[1]
    if rest:
        joined = MPI.Datatype.Create_struct([1, rest], [0, whole * MAX_COUNT * extent],
                                            [blocks, mpi_type])
        blocks.Free()
    else:
        joined = blocks
    block.Free()
    sized = joined.Create_resized(0, count * extent)
    joined.Free()
    return sized


def move_spec(spec: list, per_rank: int) -> list:
    """[buffer, 1, datatype]: a [buffer, datatype] spec whose per-rank part is one derived element."""
    return [spec[0], 1, contiguous(spec[1], per_rank)]


def placed(mpi_type: MPI.Datatype, count: int, start: int) -> MPI.Datatype:
    """A committed datatype for ``count`` elements starting ``start`` elements into a buffer."""
    extent = mpi_type.Get_extent()[1]
    key = (contiguous(mpi_type, max(count, 1)).py2f(), -1 - start)
    found = _TYPES.get(key)
    if found is None:
        found = MPI.Datatype.Create_struct([1], [start * extent],
                                           [contiguous(mpi_type, max(count, 1))])
        found.Commit()
        _TYPES[key] = found
    return found


def alltoallw_specs(send: list, recv: list, counts: tuple) -> tuple[list, list]:
    """``alltoallv`` specs as ``alltoallw`` specs: one placed datatype per peer, displacement 0."""
    sc, sd, rc, rd = counts
    n = len(sc)
    zeros = [0] * n

    def side(spec, cs, ds):
        types = [placed(spec[1], c, d) if c else spec[1] for c, d in zip(cs, ds)]
        return [spec[0], ([1 if c else 0 for c in cs], zeros), types]

    return side(send, sc, sd), side(recv, rc, rd)
