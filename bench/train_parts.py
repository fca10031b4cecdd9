"""``bench train --parts``: where an FSDP2 step's time goes, measured by wrapping the calls.

While a round's timed steps run, :class:`StepParts` times (wall clock, this rank) every call of
FSDP2's collective objects (its own ``DefaultAllGather`` / ``DefaultReduceScatter`` and
``compressed.fsdp``'s ``QuantizedAllGather`` / ``QuantizedReduceScatter``) and, inside them,
the int8 kernels (``compressed.fsdp._numba_int8``): ``quantize`` / ``quantize_bf16`` (pack) and
``dequantize`` / ``dequantize_bf16`` / ``reduce_into`` (unpack). Per step:

- ``coll``: time inside the collective calls (pack + transfer + unpack, and the calls' own work);
- ``pack``, ``unpack``: time inside the kernels;
- ``wire`` = coll - pack - unpack: the transfer and the per-call work around it;
- ``compute`` = step - coll: forward, backward and FSDP2's own copies, with no collective running.

Async calls (``--fsdp-prefetch``) are timed from the call to its return only (their ``wait()``
is in ``compute``). The CUDA path's torch kernels are not wrapped (they would need syncs).
"""
from __future__ import annotations

import time
from contextlib import contextmanager

__all__ = ["PARTS", "StepParts", "parts_text"]

PARTS = ("compute", "coll", "pack", "wire", "unpack")
_PACK = ("quantize", "quantize_bf16")
_UNPACK = ("dequantize", "dequantize_bf16", "reduce_into")


class StepParts:
    """Seconds spent in collective calls and int8 kernels while active (see the module doc)."""

    def __init__(self) -> None:
        self.seconds = {"coll": 0.0, "pack": 0.0, "unpack": 0.0}
        self._depth = 0  # nested collective calls count once

    def _timed(self, fn, part: str):
        def wrapper(*args, **kwargs):
            if part == "coll":
                self._depth += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                if part != "coll":
                    self.seconds[part] += dt
                else:
                    self._depth -= 1
                    if self._depth == 0:
                        self.seconds[part] += dt
        return wrapper

    @contextmanager
    def active(self):
        """Wrap the calls while the block runs (restored after)."""
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

        from compressed.fsdp import QuantizedAllGather, QuantizedReduceScatter
        targets = [(cls, "__call__", "coll") for cls in (
            fc.DefaultAllGather, fc.DefaultReduceScatter, QuantizedAllGather,
            QuantizedReduceScatter)]
        try:
            from compressed.fsdp import _numba_int8 as kernels
        except ImportError:  # no numba: the numpy / torch twins run, not split out
            kernels = None
        if kernels is not None:
            targets += [(kernels, name, "pack") for name in _PACK]
            targets += [(kernels, name, "unpack") for name in _UNPACK]
        saved = [(obj, name, obj.__dict__[name]) for obj, name, _ in targets]
        try:
            for obj, name, part in targets:
                setattr(obj, name, self._timed(obj.__dict__[name], part))
            yield self
        finally:
            for obj, name, fn in saved:
                setattr(obj, name, fn)

    def per_step(self, step_seconds: float, steps: int) -> dict[str, float]:
        """``{part: seconds per step}`` given the steps' mean time (see ``PARTS``)."""
        s = {k: v / steps for k, v in self.seconds.items()}
        s["wire"] = s["coll"] - s["pack"] - s["unpack"]
        s["compute"] = step_seconds - s["coll"]
        return s


def parts_text(rec: dict) -> str:
    """``peer: compute X, collectives Y (pack a, wire b, unpack c) ms`` of a step record."""
    p = {k: rec[f"{k}_ms"] for k in PARTS}
    return (f"{rec['peer']}: compute {p['compute']:.1f}, collectives {p['coll']:.1f} (pack "
            f"{p['pack']:.1f}, wire {p['wire']:.1f}, unpack {p['unpack']:.1f}) ms")
