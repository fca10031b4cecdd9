"""Point-to-point calls of the Communicator (a mixin: it uses the Communicator's launch path)."""
from __future__ import annotations

from mpi4py import MPI

from . import large
from .buffers import IN, OUT, prepare, to_tensor
from .errors import check_rank, fail_value
from .observe import observed
from .validate import move_type
from .work import Work


class PointToPoint:
    """send/recv/isend/irecv of one tensor, numpy or cupy array."""

    @observed
    def send(self, tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``dst`` (blocking)."""
        self._p2p("send", tensor, dst, tag, async_op=False)

    @observed
    def recv(self, tensor, src: int | None = None, tag: int = 0) -> int:
        """Receive into ``tensor`` from rank ``src`` (None: any rank); return the sender's rank."""
        return self._p2p("recv", tensor, src, tag, async_op=False)

    @observed
    def isend(self, tensor, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to rank ``dst``."""
        return self._p2p("isend", tensor, dst, tag, async_op=True)

    @observed
    def irecv(self, tensor, src: int | None = None, tag: int = 0) -> Work:
        """Start receiving into ``tensor`` from rank ``src`` (None: any rank)."""
        return self._p2p("irecv", tensor, src, tag, async_op=True)

    def _p2p(self, call: str, tensor, peer, tag: int, async_op: bool):
        sending = call.endswith("send")
        if peer is None and not sending:
            peer = MPI.ANY_SOURCE
        else:
            peer = check_rank(call, "dst" if sending else "src", peer, self.size)
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= self._tag_ub:
            fail_value(call, "tag", f"an int in [0, {self._tag_ub}]", repr(tag))
        t = to_tensor(tensor, call, "tensor", writable=not sending)
        mpi_type = move_type(call, "tensor", t)
        slot = prepare(t, IN if sending else OUT, mpi_type, t.dtype, self.device_policy, call)
        spec = slot.spec
        if large.too_big(t.numel()):
            spec = large.move_spec(spec, t.numel())
        if sending:
            return self._launch(self.mpi_comm.Send, self.mpi_comm.Isend, (spec, peer, tag),
                                [slot], async_op, [tensor])
        if async_op:
            return self._launch(self.mpi_comm.Recv, self.mpi_comm.Irecv, (spec, peer, tag),
                                [slot], True, [tensor])
        status = MPI.Status()
        self._launch(self.mpi_comm.Recv, self.mpi_comm.Irecv, (spec, peer, tag, status),
                     [slot], False, [tensor])
        return status.Get_source()
