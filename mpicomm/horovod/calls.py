"""The kinds of call: what each checks across ranks and which data collective it posts."""
from __future__ import annotations

import numpy as np
import torch

from mpicomm.errors import CollectiveMismatchError
from mpicomm.ops import ReduceOp

from .engine import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, ERROR, F_DEVICE, F_DTYPE,
                     F_KIND, F_NDIM, F_OP, F_ROOT, F_SHAPE, JOIN, REDUCESCATTER, Op, mismatch,
                     same_kind_or_fail, shapes)

# Horovod's op values
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
            Product: "Product"}
MPI_OP = {Average: ReduceOp.SUM, Sum: ReduceOp.SUM, Min: ReduceOp.MIN, Max: ReduceOp.MAX,
          Product: ReduceOp.PROD}


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype Horovod scales in: float64 for integers, float32 for 16-bit floats on the CPU."""
    if not t.is_floating_point():
        return torch.float64
    if t.dtype in (torch.float16, torch.bfloat16) and not t.is_cuda:
        return torch.float32
    return t.dtype


def scale_(t: torch.Tensor, factor: float) -> None:
    """``t *= factor`` as Horovod computes it (see :func:`compute_dtype`)."""
    if factor == 1.0 or t.dtype == torch.bool:
        return
    c = compute_dtype(t)
    f = torch.tensor(float(factor), dtype=torch.float64, device=t.device).to(c)
    if c == t.dtype:
        t.mul_(f)
    else:
        t.copy_((t.to(c) * f).to(t.dtype))


def finish_reduction(t: torch.Tensor, op: int, postscale: float, n: int) -> None:
    """Postscale the sum, and divide it by ``n`` for Average (integers: truncating)."""
    if op != Average:
        scale_(t, postscale)
    elif not t.is_floating_point() and postscale == 1.0:
        t.copy_(torch.div(t, n, rounding_mode="trunc"))
    else:
        scale_(t, postscale / n)


def check_same(op: Op, descs: np.ndarray, ranks: list[int], rest_only: bool = False,
               root: bool = False, reduce_op: bool = False) -> None:
    """Same dtype, device and shape (all but the first dimension with ``rest_only``) on ``ranks``."""
    for field, what in ((F_DTYPE, "dtypes"), (F_DEVICE, "devices (CPU and GPU)")):
        if len({int(descs[r, field]) for r in ranks}) > 1:
            raise mismatch(op, what, descs, ranks)
    sh = shapes(descs, ranks)
    key = {tuple(s[1:]) if rest_only else tuple(s) for s in sh.values()}
    if rest_only and len({len(s) for s in sh.values()}) > 1 or len(key) > 1:
        what = "shapes beyond the first dimension" if rest_only else "shapes"
        raise mismatch(op, what, descs, ranks)
    if reduce_op and len({int(descs[r, F_OP]) for r in ranks}) > 1:
        ops = ", ".join(f"rank {r}: {OP_NAMES.get(int(descs[r, F_OP]))}" for r in ranks)
        raise CollectiveMismatchError(f"{op.label}: mismatched reduction ops across ranks ({ops})")
    if root and len({int(descs[r, F_ROOT]) for r in ranks}) > 1:
        roots = ", ".join(f"rank {r}: {int(descs[r, F_ROOT])}" for r in ranks)
        raise CollectiveMismatchError(
            f"{op.label}: mismatched root_rank across ranks ({roots}); every rank must pass the same root")


def allreduce_ranks(op: Op, eng, descs: np.ndarray) -> tuple[list[int], list[int]]:
    """(ranks reducing, ranks joined) of an allreduce round, or raise (same on every rank)."""
    joined = same_kind_or_fail(op, eng, descs, joined_ok=True, kind=ALLREDUCE)
    active = [r for r in range(eng.size) if r not in joined]
    check_same(op, descs, active, reduce_op=True)
    code = int(descs[active[0], F_OP])
    if joined and code not in (Sum, Average):
        raise CollectiveMismatchError(
            f"{op.label}: rank(s) {joined} have called hvd.join(); joined ranks add zeros, which "
            f"works for Sum and Average, not {OP_NAMES.get(code)}")
    return active, joined


class AllreduceOp(Op):
    kind = ALLREDUCE

    def __init__(self, label, out, name, op, prescale, postscale):
        super().__init__(label, out, name, op=op)
        self.out, self.op, self.prescale, self.postscale = out, op, prescale, postscale

    def check(self, eng, descs):
        allreduce_ranks(self, eng, descs)

    def run(self, eng, descs):
        out = self.out
        scale_(out, self.prescale)
        yield eng.data.all_reduce(out, op=MPI_OP[self.op], async_op=True)
        finish_reduction(out, self.op, self.postscale, eng.size)
        self.result = out


class JoinOp(Op):
    """One round of a joined rank: all joined ends the join; an allreduce gets our zeros."""
    kind = JOIN

    def __init__(self, label, device):
        super().__init__(label)
        self.device = device

    def check(self, eng, descs):
        pass

    def run(self, eng, descs):
        kinds = descs[:, F_KIND]
        if all(k == JOIN for k in kinds):
            last = max(range(eng.size), key=lambda r: (eng.join_round[r], r))
            eng.join_round.clear()
            self.result = ("joined", last)
            return
        active = [r for r in range(eng.size) if kinds[r] != JOIN]
        ref = descs[active[0]]
        if ref[F_KIND] != ALLREDUCE:
            return  # the others raise: only allreduce goes on with joined ranks
        try:
            allreduce_ranks(self, eng, descs)
        except CollectiveMismatchError:
            return  # the others raise it
        shape = [int(x) for x in ref[F_SHAPE:F_SHAPE + int(ref[F_NDIM])]]
        from .engine import DTYPES
        dev = torch.device("cuda", max(self.device, 0)) if ref[F_DEVICE] else torch.device("cpu")
        zeros = torch.zeros(shape, dtype=DTYPES[int(ref[F_DTYPE])], device=dev)
        yield eng.data.all_reduce(zeros, op=ReduceOp.SUM, async_op=True)


class ErrorOp(Op):
    """Sent in place of a call that failed here, so that the other ranks raise instead of wait."""
    kind = ERROR

    def check(self, eng, descs):
        pass

    def run(self, eng, descs):
        return
        yield  # pragma: no cover


class AllgatherOp(Op):
    kind = ALLGATHER

    def __init__(self, label, tensor, name):
        super().__init__(label, tensor.reshape(1) if tensor.dim() == 0 else tensor, name)

    def check(self, eng, descs):
        same_kind_or_fail(self, eng, descs)
        check_same(self, descs, list(range(eng.size)), rest_only=True)

    def run(self, eng, descs):
        t = self.tensor.contiguous()
        firsts = [int(descs[r, F_SHAPE]) for r in range(eng.size)]
        rest = list(t.shape[1:])
        out = torch.empty([sum(firsts)] + rest, dtype=t.dtype, device=t.device)
        if len(set(firsts)) == 1:
            yield eng.data.all_gather_into_tensor(out, t, async_op=True)
        else:
            most = max(firsts)
            padded = torch.zeros([most] + rest, dtype=t.dtype, device=t.device)
            padded[:t.shape[0]] = t
            big = torch.empty([most * eng.size] + rest, dtype=t.dtype, device=t.device)
            yield eng.data.all_gather_into_tensor(big, padded, async_op=True)
            at = 0
            for r, n in enumerate(firsts):
                out[at:at + n] = big[r * most:r * most + n]
                at += n
        self.result = out


class BroadcastOp(Op):
    kind = BROADCAST

    def __init__(self, label, out, name, root):
        super().__init__(label, out, name, root=root)
        self.out, self.root = out, root

    def check(self, eng, descs):
        same_kind_or_fail(self, eng, descs)
        check_same(self, descs, list(range(eng.size)), root=True)

    def run(self, eng, descs):
        buf = self.out if self.out.is_contiguous() else self.out.contiguous()
        yield eng.data.broadcast(buf, src=self.root, async_op=True)
        if buf is not self.out:
            self.out.copy_(buf)
        self.result = self.out


class AlltoallOp(Op):
    kind = ALLTOALL

    def __init__(self, label, tensor, name, splits: list[int], given: bool):
        super().__init__(label, tensor, name, flag=int(given))
        self.splits = splits

    def check(self, eng, descs):
        same_kind_or_fail(self, eng, descs)
        check_same(self, descs, list(range(eng.size)), rest_only=True)

    def run(self, eng, descs):
        t = self.tensor
        send = torch.tensor(self.splits, dtype=torch.int64)
        recv = torch.empty(eng.size, dtype=torch.int64)
        yield eng.data.all_to_all_single(recv, send, async_op=True)
        inp = t[:sum(self.splits)].contiguous()
        got = [int(x) for x in recv]
        out = torch.empty([sum(got)] + list(t.shape[1:]), dtype=t.dtype, device=t.device)
        yield eng.data.all_to_all_single(out, inp, output_split_sizes=got,
                                         input_split_sizes=list(self.splits), async_op=True)
        self.result = (out, recv.to(torch.int32))


def scatter_counts(rows: int, n: int) -> list[int]:
    """Rows each rank receives from a reducescatter of ``rows`` rows (the first ranks one more)."""
    return [rows // n + (1 if r < rows % n else 0) for r in range(n)]


class ReducescatterOp(Op):
    kind = REDUCESCATTER

    def __init__(self, label, tensor, name, op, prescale, postscale):
        super().__init__(label, tensor, name, op=op)
        self.op, self.prescale, self.postscale = op, prescale, postscale

    def check(self, eng, descs):
        same_kind_or_fail(self, eng, descs)
        check_same(self, descs, list(range(eng.size)), reduce_op=True)

    def run(self, eng, descs):
        t = self.tensor.clone(memory_format=torch.contiguous_format)
        scale_(t, self.prescale)
        n, rest = eng.size, list(t.shape[1:])
        counts = scatter_counts(t.shape[0], n)
        most = max(counts)
        if len(set(counts)) == 1:
            out = torch.empty([most] + rest, dtype=t.dtype, device=t.device)
            yield eng.data.reduce_scatter_tensor(out, t, op=MPI_OP[self.op], async_op=True)
        else:
            padded = torch.zeros([most * n] + rest, dtype=t.dtype, device=t.device)
            at = 0
            for r, c in enumerate(counts):
                padded[r * most:r * most + c] = t[at:at + c]
                at += c
            full = torch.empty([most] + rest, dtype=t.dtype, device=t.device)
            yield eng.data.reduce_scatter_tensor(full, padded, op=MPI_OP[self.op], async_op=True)
            out = full[:counts[eng.rank]].clone()
        finish_reduction(out, self.op, self.postscale, n)
        self.result = out
