"""The 1-bit gradient reduce-scatter of one FSDP parameter group: the 1-bit engine's
reduce-scatter phase with error feedback, on FSDP2's (ranks x shard) rows.

Each rank forms ``x = g + e`` over its whole padded gradient (rows of ``m`` padded to ``m8``, a
multiple of 8 elements, zeros there), sends the signs of row ``j`` to rank ``j`` with one scale
``s = sqrt(sum(x**2) / (ranks * m8))`` and keeps ``e = x - s * sign(x)`` (sign +1 at 0); rank
``j`` gets ``mean_i(s_i * sign(x_i[j]))`` (``compressed.engine.reduce_scatter``), times the
rank count for SUM (and FSDP2's PREMUL_SUM factor). The worker error ``e`` (fp32, ranks x m8
elements) is this state's: one per FSDPModule.

A warm-up (``warmup_steps``, as DeepSpeed's 1-bit methods freeze before compressing): the first
``warmup_steps`` calls are full-precision reduce-scatters and the error feedback starts, at
zero, with the first 1-bit call. A call is a step: FSDP2 reduce-scatters each module's
gradients once per optimizer step (once per accumulation window). The count is state
(``state_dict``), so a resumed run compresses from the same step.
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import engine
from ..compressor import Compressor

__all__ = ["InFlight", "OnebitState", "padded_row", "check_warmup", "DEFAULT_WARMUP_STEPS"]

#: Full-precision steps before the 1-bit reduce-scatters start (``quantize_comms``'s default).
DEFAULT_WARMUP_STEPS = 20


def check_warmup(warmup_steps: object, bits: int | None, what: str,
                 default: int = DEFAULT_WARMUP_STEPS) -> int:
    """``warmup_steps`` checked (a whole number >= 0; None: ``default`` for ``bits=1``, else 0);
    a warm-up for other than 1-bit gradients raises ValueError naming ``what``."""
    if warmup_steps is None:
        return default if bits == 1 else 0
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ValueError(f"{what}: expected warmup_steps as a whole number of steps >= 0 (None: "
                         f"the default, {default} for 1-bit gradients), got {warmup_steps!r}")
    if warmup_steps and bits != 1:
        raise ValueError(f"{what}: warmup_steps={warmup_steps} applies to 1-bit gradients "
                         f"(grad_bits=1) only; got bits={bits!r}, which has no warm-up")
    return warmup_steps


def padded_row(m: int) -> int:
    """Row length on the wire: ``m`` rounded up to a multiple of 8 (signs pack 8 per byte)."""
    return -(-m // 8) * 8


class InFlight:
    """A started call: calling it finishes it (once, whoever calls first); ``done`` says
    whether it has been finished (or failed while finishing)."""

    __slots__ = ("_finish",)

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Callable[[], None] | None = finish

    @property
    def done(self) -> bool:
        return self._finish is None

    def __call__(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


class OnebitState:
    """Worker error, warm-up count and compressor of one FSDP parameter group's 1-bit
    reduce-scatter: the first ``warmup_steps`` calls run at full precision."""

    def __init__(self, warmup_steps: int = 0) -> None:
        self.warmup_steps = check_warmup(warmup_steps, 1, "OnebitState", 0)
        self.steps = 0  # calls so far, warm-up ones included
        self.world: int | None = None
        self.m: int | None = None
        self.worker_error: torch.Tensor | None = None
        self._compressors: dict[tuple[int, bool], Compressor] = {}
        self._pending: InFlight | None = None  # the call in flight
        self._rows: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._host_views: tuple | None = None  # (what they were made for, size, _host's views)

    def shape_check(self, world: int, m: int) -> None:
        """Raise unless this state is unused or belongs to calls of ``world`` x ``m``."""
        if self.m is not None and (self.world, self.m) != (world, m):
            raise ValueError(
                f"QuantizedReduceScatter(bits=1): its error feedback belongs to one FSDP "
                f"parameter group ({self.world} ranks x {self.m} elements), now called with "
                f"{world} x {m}; give every FSDPModule its own (quantize_comms does)")

    def count_step(self) -> bool:
        """Count a call; True while it is one of the warm-up's (full precision)."""
        self.steps += 1
        return self.steps <= self.warmup_steps

    def errors(self, world: int, m: int, device: torch.device) -> torch.Tensor:
        """The worker error (fp32, world x padded_row(m)), zeros when new."""
        self.shape_check(world, m)
        if self.worker_error is None:
            self.world, self.m = world, m
            self.worker_error = torch.zeros(world * padded_row(m), dtype=torch.float32,
                                            device=device)
        elif self.worker_error.device != device:  # loaded on the host, used on the device
            self.worker_error = self.worker_error.to(device)
        return self.worker_error

    def _comm(self, group: dist.ProcessGroup, direct) -> Compressor:
        key = (id(group), direct is not None)
        comp = self._compressors.get(key)
        if comp is None:
            if len(self._compressors) > 4:  # groups come and go (tests): keep a few
                self._compressors.clear()
            comp = self._compressors[key] = Compressor(
                direct if direct is not None else group, hierarchical=False)
        return comp

    def settle(self) -> None:
        """Finish the call in flight, if any (errors raised here)."""
        call, self._pending = self._pending, None
        if call is not None:
            call()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                       direct: Any, mult: float,
                       async_op: bool = False) -> InFlight | None:
        """``output`` (m) = ``mult`` x the 1-bit mean of every rank's row ``rank`` of ``input``
        (world x m), error feedback updated. ``direct``: the mpicomm Communicator or None (the
        group's own calls). With ``async_op`` the signs are packed and posted now and calling
        the returned ``InFlight`` (or ``settle``, or the next call) waits and writes ``output``
        and the error; ``input`` must stay unchanged until then."""
        self.settle()  # one call in flight per state: they share the buffers
        world, m = (group.size() if direct is None else int(direct.size)), output.numel()
        e = self.errors(world, m, input.device)
        m8 = padded_row(m)
        host_bf16 = (not async_op and input.is_cpu and input.dtype == torch.bfloat16
                     and not input.is_neg())     # widened in the blocking host kernels
        if m8 == m and input.is_contiguous() and (input.dtype == torch.float32 or not input.is_cpu
                                                  or host_bf16):
            flat = input.reshape(-1)
        else:
            if self._rows is None:
                self._rows = torch.zeros(world, m8, dtype=torch.float32, device=input.device)
            self._rows[:, :m].copy_(input.reshape(world, m))
            flat = self._rows.view(-1)
        if self._out is None:
            self._out = torch.empty(m8, dtype=torch.float32, device=input.device)
        comp = self._comm(group, direct)
        if not async_op and flat.is_cpu and (flat.dtype == torch.float32 and not flat.is_neg()
                                             or flat.dtype == torch.bfloat16):   # host_bf16
            host = self._host(comp, flat.numel(), e)
            if host is not None:    # the engine on the kept host views: no per-call checks
                fam, lay, ws, e_np, out_np = host
                g = (flat.detach().numpy() if flat.dtype == torch.float32     # bf16: its bits
                     else flat.detach().view(torch.int16).numpy().view(np.uint16))
                engine.reduce_scatter_start(comp.comm, fam, lay, g, out_np, e_np, ws, False)()
                comp.count_reduce_scatter(lay)
                if (output.dtype == torch.float32 and output.is_cpu and output.is_contiguous()
                        and not output.is_neg()):
                    np.multiply(out_np[:m], np.float32(mult), out=output.detach().view(-1).numpy())
                else:
                    if mult != 1.0:
                        np.multiply(out_np[:m], np.float32(mult), out=out_np[:m])
                    output.view(-1).copy_(self._out[:m])
                return None
        mean = self._out[:m]
        transfer = comp.compressed_reduce_scatter_start(flat, self._out, e, async_op=async_op)

        def write() -> None:
            transfer()
            if mult != 1.0:
                mean.mul_(mult)     # the scratch result, rounded once into output below
            output.view(-1).copy_(mean)
        call = InFlight(write)
        if not async_op:
            call()
            return None
        self._pending = call
        return call

    def _host(self, comp: Compressor, n: int, e: torch.Tensor) -> tuple | None:
        """``(family, layout, workspace, error view, output view)`` for a blocking host call of
        ``n`` elements on ``comp``, made once (None: ``comp``'s kernels are not host ones). Our own
        buffers only, so ``Compressor``'s per-call checks have nothing to find."""
        key = (comp, e, self._out)
        if self._host_views is not None and self._host_views[1] == n \
                and all(a is b for a, b in zip(self._host_views[0], key)):
            return self._host_views[2]
        plan = comp.host_plan(e, n)
        if plan is None:
            return None
        fam, lay, ws = plan
        views = (fam, lay, ws, fam.view(e), fam.view(self._out))
        self._host_views = (key, n, views)
        return views

    def state_dict(self) -> dict[str, Any]:
        """``{"world_size", "numel", "worker_error", "steps"}`` (the first three None before the
        first 1-bit call; ``steps`` the calls so far, warm-up included); a call in flight is
        finished first."""
        self.settle()
        return {"world_size": self.world, "numel": self.m, "worker_error": self.worker_error,
                "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a worker error saved for ``world_size`` ranks x ``numel`` (checked at the next
        call against the group it runs on) and the step count (a state saved without one, before
        the warm-up existed, compressed from its first call: the warm-up counts as over); a call
        in flight is finished first."""
        self.settle()
        world, m, e = state["world_size"], state["numel"], state["worker_error"]
        steps = state.get("steps")
        if steps is None:
            steps = self.warmup_steps if e is not None else 0
        try:
            steps = operator.index(steps)
        except TypeError:
            steps = -1
        if isinstance(state.get("steps"), bool) or steps < 0:
            raise ValueError(f"QuantizedReduceScatter(bits=1): expected a saved step count as a "
                             f"whole number >= 0, got {state.get('steps')!r}")
        self.steps = steps
        if e is None:
            self.world = self.m = self.worker_error = None
            return
        world, m = int(world), int(m)
        if e.numel() != world * padded_row(m):
            raise ValueError(f"QuantizedReduceScatter(bits=1): a worker error of {e.numel()} "
                             f"elements cannot belong to {world} ranks x {m} elements; expected "
                             f"{world * padded_row(m)}")
        device = self.worker_error.device if self.worker_error is not None else e.device
        if (world, m) != (self.world, self.m):   # buffers of another shape go
            self._rows = self._out = self._host_views = None
        self.world, self.m = world, m
        self.worker_error = e.detach().to(device, torch.float32).reshape(-1).clone()
