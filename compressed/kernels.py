"""CPU compression kernels: numba-fused when numba is importable, plain numpy otherwise.

``module(name)`` returns an implementation: ``_numba_kernels`` or ``_numpy_kernels``, the same
functions with the same results. ``name`` None is the default: ``MPICOMM_COMPRESSED_KERNELS=
numba|numpy`` when set, else numba when it imports, else numpy. Nothing global is switched:
``families.HostFamily`` holds the module it runs (``families.family_for`` is where a call's
kernels are chosen).

All arrays are numpy, float32 for values and uint8 for packed signs (8 per byte, most
significant bit first, bit 1 meaning ``x >= 0``). ``rows`` arrays are (world_size,
chunk_bytes) views whose rows may be strided (they live inside message buffers). Each
implementation has:

- ``encode(g, e, rows)``: pack the signs of x = (g zero-padded to e's size) + e into ``rows``;
  return sum(x^2). ``g`` (m elements, m <= e.size) and ``e`` are only read.
- ``encode_into(g, e, pend, xout, rows)``: one fused pass: x = (g zero-padded) +
  (e - pend * sign(e)) written to ``xout`` (e's size; may be ``e``), x's signs packed into
  ``rows``; return sum(x^2). With ``pend`` = 0 the correction is exact identity (x = g + e).
- ``encode_mean_into(a, b, parts, e, pend, xout, rows)``: ``encode_into`` with
  g = (a + b) / parts, computed in the same pass and rounded as ``add_mean`` rounds it.
- ``worker_residual(g, e, scale)``: e = x - scale * sign(x), x = (g zero-padded) + e, computed
  exactly as in ``encode``.
- ``encode_bf16(gb, e, rows)``, ``worker_residual_bf16(gb, e, scale)``: the same with g given
  as bfloat16 bits (a uint16 array), widened to float32 (exact) inside the pass.
- ``server_accumulate(rows, coef, se, out, pend)``: se = sum_i coef[i] * sign(rows[i]) +
  (se - pend * sign(se)); pack sign(se) into ``out``; return sum(se^2). ``coef`` is
  contiguous float32; ``pend`` a deferred server error update (0: none).
- ``server_residual(se, scale)``: se = se - scale * sign(se) (also how a deferred error update
  is applied).
- ``decode(rows, scales, out)``: scales[r] * sign(rows[r]) for every chunk r into ``out``, cut at
  out's length; ``scales`` contiguous float32.
- ``add_mean(a, b, parts, out)``: out = (a + b) / parts in float32, rounded as an add then a
  divide; ``out`` may be ``a``.
"""
from __future__ import annotations

import os
from types import ModuleType

__all__ = ["ENV", "module", "implementation_of"]

#: Environment variable that forces the default implementation ("numba" or "numpy").
ENV = "MPICOMM_COMPRESSED_KERNELS"


def _load(name: str) -> ModuleType:
    if name == "numba":
        from . import _numba_kernels as mod
        return mod
    if name == "numpy":
        from . import _numpy_kernels as mod
        return mod
    raise ValueError(f"compressed kernels: expected 'numba' or 'numpy', got {name!r}")


def module(name: str | None = None) -> ModuleType:
    """The implementation 'numba' or 'numpy'; None: ``MPICOMM_COMPRESSED_KERNELS`` when set,
    else numba when it imports, else numpy."""
    if name is None:
        name = os.environ.get(ENV, "").strip().lower() or None
    if name is not None:
        return _load(name)
    try:
        return _load("numba")
    except ImportError:
        return _load("numpy")


def implementation_of(mod: ModuleType) -> str:
    """Name ('numba' or 'numpy') of an implementation module from ``module``."""
    return "numba" if mod.__name__.endswith("_numba_kernels") else "numpy"
