"""Test data for the collective tests: per-rank inputs and independent numpy references."""
from __future__ import annotations

import numpy as np
import torch

TORCH_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
NUMPY_DTYPES = [np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8,
                np.uint8, np.bool_]
FLOAT_TORCH = {torch.float64, torch.float32, torch.float16, torch.bfloat16}


def values(rank: int, n: int, dtype, seed: int = 0, positive: bool = False) -> np.ndarray:
    """Deterministic float64 values for ``rank``, exactly representable in ``dtype`` and small
    enough that sums and products over 4 ranks stay exact and in range."""
    rng = np.random.default_rng(1000 * seed + rank)
    name = str(dtype)
    if "bool" in name:
        return rng.integers(0, 2, n).astype(np.float64)
    if "uint8" in name or positive:
        return rng.integers(1, 4, n).astype(np.float64)
    if "int" in name:
        return rng.integers(-3, 4, n).astype(np.float64)
    return rng.integers(-8, 9, n) / 4.0


def make(framework: str, data: np.ndarray, dtype, shape=None):
    """A torch tensor or numpy array of ``dtype`` holding ``data``."""
    shape = shape or data.shape
    if framework == "torch":
        t = torch.from_numpy(data.reshape(shape).copy())
        return t.to(dtype)
    return data.reshape(shape).astype(dtype)


def to_f64(x) -> np.ndarray:
    """float64 numpy copy of a torch tensor or numpy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x).astype(np.float64)


def reduce_ref(stack: np.ndarray, op: str, is_bool: bool) -> np.ndarray:
    """Reference reduction over axis 0 of per-rank float64 inputs."""
    bitwise = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}.get(op)
    if bitwise is not None:  # integers (two's complement, as every width) and bools (0/1)
        return bitwise.reduce(stack.astype(np.int64), axis=0).astype(np.float64)
    if is_bool:
        if op in ("sum", "max"):
            return stack.max(axis=0)
        return stack.min(axis=0)
    return {"sum": stack.sum(axis=0), "avg": stack.mean(axis=0), "max": stack.max(axis=0),
            "min": stack.min(axis=0), "prod": stack.prod(axis=0)}[op]


def tolerance(dtype) -> float:
    """Relative tolerance for a result rounded once to ``dtype``."""
    name = str(dtype)
    if "bfloat16" in name:
        return 2 ** -8
    if "float16" in name:
        return 2 ** -11
    if "float32" in name:
        return 2 ** -23
    return 0.0
