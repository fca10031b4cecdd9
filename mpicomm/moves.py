"""The Communicator's moves: broadcast, gathers, scatter, all-to-all (a mixin on its launch path).

Each validates, adapts the buffers (staging, a flat buffer for lists) and calls MPI's move; a
rank's part beyond MPI's counts goes as one derived element (``mpicomm.large``).
"""
from __future__ import annotations

import torch
from mpi4py import MPI

from . import fastpath, large
from .buffers import IN, OUT, Slot, host_overlap, prepare, to_tensor
from .checking import agree, signature
from .errors import check_rank, describe, fail_value
from .observe import observed, observed_as
from .validate import move_type, out_and_in, per_rank_list, root_list, splits
from .work import Work


class Moves:
    """broadcast, all_gather_into_tensor, all_gather, all_to_all_single, gather and scatter."""


    @fastpath.broadcast
    def broadcast(self, tensor, src: int = 0, async_op: bool = False) -> Work | None:
        """Copy ``tensor`` from rank ``src`` into ``tensor`` on every rank."""
        return self._broadcast(tensor, src, async_op)

    @observed_as("broadcast")
    def _broadcast(self, tensor, src, async_op):
        call = "broadcast"
        src = check_rank(call, "src", src, self.size)
        t = to_tensor(tensor, call, "tensor", writable=self.rank != src)
        mpi_type = move_type(call, "tensor", t)
        if self.check:
            agree(self.mpi_comm, call, f"src={src}, tensor={signature(t)}")
        slot = prepare(t, IN if self.rank == src else OUT, mpi_type, t.dtype, self.device_policy,
                       "ibcast" if async_op else "bcast")
        return self._launch(self.mpi_comm.Bcast, self.mpi_comm.Ibcast,
                            (_spec(slot, t.numel()), src), [slot], async_op, [tensor])

    @fastpath.all_gather_into_tensor
    def all_gather_into_tensor(self, output_tensor, input_tensor,
                               async_op: bool = False) -> Work | None:
        """Concatenate every rank's ``input_tensor`` (in rank order) into ``output_tensor``."""
        return self._all_gather_into_tensor(output_tensor, input_tensor, async_op)

    @observed_as("all_gather_into_tensor")
    def _all_gather_into_tensor(self, output_tensor, input_tensor, async_op):
        call = "all_gather_into_tensor"
        out, inp = out_and_in(call, ("output_tensor", "input_tensor"), output_tensor, input_tensor)
        if out.numel() != self.size * inp.numel():
            fail_value(call, "output_tensor", f"{self.size} x input_tensor.numel() = "
                       f"{self.size * inp.numel()} elements", f"{out.numel()} ({describe(output_tensor)})")
        mpi_type = move_type(call, "input_tensor", inp)
        if self.check:
            agree(self.mpi_comm, call, f"output={signature(out)}, input={signature(inp)}")
        mpi_call = "iallgather" if async_op else "allgather"
        recv = prepare(out, OUT, mpi_type, out.dtype, self.device_policy, mpi_call)
        slots = [recv]
        if (host_overlap(out, inp) and recv.work is out and inp.is_contiguous() and not inp.is_neg()
                and inp.data_ptr() == out.data_ptr() + self.rank * inp.numel() * inp.element_size()):
            send_spec = MPI.IN_PLACE  # the input already sits in this rank's slot
        else:
            send = prepare(inp.clone() if host_overlap(out, inp) else inp, IN, mpi_type, inp.dtype,
                           self.device_policy, mpi_call)
            slots.append(send)
            send_spec = _spec(send, inp.numel())
        return self._launch(self.mpi_comm.Allgather, self.mpi_comm.Iallgather,
                            (send_spec, _spec(recv, inp.numel())), slots, async_op,
                            [output_tensor])

    @observed
    def all_gather(self, tensor_list: list, tensor, async_op: bool = False) -> Work | None:
        """Gather every rank's ``tensor`` into ``tensor_list[r]`` on every rank."""
        call = "all_gather"
        inp = to_tensor(tensor, call, "tensor", writable=False)
        outs = per_rank_list(call, "tensor_list", tensor_list, inp, self.size)
        flat = torch.empty((self.size * inp.numel(),), dtype=inp.dtype, device=inp.device)
        if self.check:
            agree(self.mpi_comm, call, f"tensor={signature(inp)}")
        mpi_call = "iallgather" if async_op else "allgather"
        mpi_type = move_type(call, "tensor", inp)
        send = prepare(inp, IN, mpi_type, inp.dtype, self.device_policy, mpi_call)
        recv = prepare(flat, OUT, mpi_type, inp.dtype, self.device_policy, mpi_call)
        return self._launch(self.mpi_comm.Allgather, self.mpi_comm.Iallgather,
                            (_spec(send, inp.numel()), _spec(recv, inp.numel())), [send, recv],
                            async_op, tensor_list, extra=[lambda: _unflatten_into(flat, outs)])

    @fastpath.all_to_all_single
    def all_to_all_single(self, output, input, output_split_sizes: list[int] | None = None,
                          input_split_sizes: list[int] | None = None,
                          async_op: bool = False) -> Work | None:
        """Rank r sends its j-th chunk of ``input`` (along dim 0) to rank j, which stores it as
        chunk r of ``output``."""
        return self._all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op)

    @observed_as("all_to_all_single")
    def _all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, async_op):
        call = "all_to_all_single"
        out, inp = out_and_in(call, ("output", "input"), output, input)
        mpi_type = move_type(call, "input", inp)
        mpi_call = "ialltoallv" if async_op else "alltoallv"
        if output_split_sizes is None and input_split_sizes is None:
            if out.numel() != inp.numel() or inp.numel() % self.size:
                fail_value(call, "output", f"output.numel() == input.numel(), divisible by "
                           f"{self.size} ranks", f"output {describe(output)}, input {describe(input)}")
            counts = None
            mpi_call = "ialltoall" if async_op else "alltoall"
        else:
            send_counts, send_displs = splits(call, "input_split_sizes", input_split_sizes, inp,
                                              self.size)
            recv_counts, recv_displs = splits(call, "output_split_sizes", output_split_sizes, out,
                                              self.size)
            counts = (send_counts, send_displs, recv_counts, recv_displs)
        if self.check:
            agree(self.mpi_comm, call, f"dtype={inp.dtype}" if counts else
                  f"output={signature(out)}, input={signature(inp)}")
        if host_overlap(out, inp):
            inp = inp.clone()
        send = prepare(inp, IN, mpi_type, inp.dtype, self.device_policy, mpi_call)
        recv = prepare(out, OUT, mpi_type, out.dtype, self.device_policy, mpi_call)
        comm = self.mpi_comm
        if counts is None:
            per_rank = inp.numel() // self.size
            args = (_spec(send, per_rank), _spec(recv, per_rank))
            return self._launch(comm.Alltoall, comm.Ialltoall, args, [send, recv], async_op,
                                [output])
        if large.too_big(*(c for part in counts for c in part)):
            args = large.alltoallw_specs(send.spec, recv.spec, counts)
            return self._launch(comm.Alltoallw, comm.Ialltoallw, args, [send, recv], async_op,
                                [output])
        sc, sd, rc, rd = counts
        args = ([send.spec[0], (sc, sd), mpi_type], [recv.spec[0], (rc, rd), mpi_type])
        return self._launch(comm.Alltoallv, comm.Ialltoallv, args, [send, recv], async_op,
                            [output])

    # gather and scatter are one shape mirrored: the same checks (``_rooted``) and one MPI call on
    # the root's flat buffer (gather splits it after, scatter joins it before).
    def _rooted(self, call: str, root_name: str, root, tensor, list_name: str, tensors,
                writable: bool) -> tuple:
        """The checks gather and scatter open with: (root, tensor, its MPI type, the root's
        list of tensors), agreed across ranks when checking."""
        root = check_rank(call, root_name, root, self.size)
        t = to_tensor(tensor, call, "tensor", writable=writable)
        mpi_type = move_type(call, "tensor", t)
        ts = root_list(call, list_name, tensors, t, root_name, root, self.rank, self.size)
        if self.check:
            agree(self.mpi_comm, call, f"{root_name}={root}, tensor={signature(t)}")
        return root, t, mpi_type, ts

    @observed
    def gather(self, tensor, gather_list: list | None = None, dst: int = 0,
               async_op: bool = False) -> Work | None:
        """Collect every rank's ``tensor`` into ``gather_list`` on rank ``dst``."""
        dst, inp, mpi_type, outs = self._rooted("gather", "dst", dst, tensor, "gather_list",
                                                gather_list, False)
        mpi_call = "igather" if async_op else "gather"
        send = prepare(inp, IN, mpi_type, inp.dtype, self.device_policy, mpi_call)
        n = inp.numel()
        if self.rank != dst:
            return self._launch(self.mpi_comm.Gather, self.mpi_comm.Igather,
                                (_spec(send, n), None, dst), [send], async_op, [])
        flat = torch.empty((self.size * n,), dtype=inp.dtype, device=inp.device)
        recv = prepare(flat, OUT, mpi_type, inp.dtype, self.device_policy, mpi_call)
        return self._launch(self.mpi_comm.Gather, self.mpi_comm.Igather,
                            (_spec(send, n), _spec(recv, n), dst), [send, recv], async_op,
                            gather_list, extra=[lambda: _unflatten_into(flat, outs)])

    @observed
    def scatter(self, tensor, scatter_list: list | None = None, src: int = 0,
                async_op: bool = False) -> Work | None:
        """Rank ``src`` sends ``scatter_list[r]`` into ``tensor`` on rank r."""
        src, out, mpi_type, ins = self._rooted("scatter", "src", src, tensor, "scatter_list",
                                               scatter_list, True)
        mpi_call = "iscatter" if async_op else "scatter"
        recv = prepare(out, OUT, mpi_type, out.dtype, self.device_policy, mpi_call)
        n = out.numel()
        if self.rank != src:
            return self._launch(self.mpi_comm.Scatter, self.mpi_comm.Iscatter,
                                (None, _spec(recv, n), src), [recv], async_op, [tensor])
        flat = torch.cat([x.reshape(-1) for x in ins])
        send = prepare(flat, IN, mpi_type, out.dtype, self.device_policy, mpi_call)
        return self._launch(self.mpi_comm.Scatter, self.mpi_comm.Iscatter,
                            (_spec(send, n), _spec(recv, n), src), [send, recv], async_op, [tensor])


def _spec(slot: Slot, per_rank: int) -> list:
    """The slot's MPI spec; one derived element per rank when ``per_rank`` is too big for MPI."""
    return large.move_spec(slot.spec, per_rank) if large.too_big(per_rank) else slot.spec


def _unflatten_into(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    for piece, out in zip(flat.chunk(len(outs)), outs):
        out.copy_(piece.view(out.shape))
