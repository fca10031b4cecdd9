"""A tree of tensors and plain values sent from one rank to the others without pickle: its
shape as JSON (tensors by dtype and shape), then each tensor through the communicator."""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch


def _spec(value: Any, tensors: list[torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return {"int": str(value)}          # exact at any size
    if isinstance(value, float):
        return {"float": value.hex()}       # exact, inf and nan included
    if isinstance(value, complex):
        return {"complex": [value.real.hex(), value.imag.hex()]}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().cpu().contiguous())
        return {"tensor": [str(value.dtype).removeprefix("torch."), list(value.shape), str(value.device)]}
    if isinstance(value, np.ndarray):
        tensors.append(torch.from_numpy(np.ascontiguousarray(value)))
        return {"ndarray": [str(value.dtype), list(value.shape)]}
    if isinstance(value, np.generic):
        return {"npscalar": [str(value.dtype), _spec(value.item(), tensors)]}
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple": [_spec(v, tensors) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[_spec(k, tensors), _spec(v, tensors)] for k, v in value.items()]}
    raise TypeError(f"elastic: cannot send a {type(value).__name__} to a joining rank; expected numbers, strings, "
                    "bytes, None, tensors, numpy arrays, and lists, tuples and dicts of those")


def _value(spec: Any, tensors: list[torch.Tensor]) -> Any:
    if spec is None or isinstance(spec, (bool, str)):
        return spec
    (kind, data), = spec.items()
    if kind == "int":
        return int(data)
    if kind == "float":
        return float.fromhex(data)
    if kind == "complex":
        return complex(float.fromhex(data[0]), float.fromhex(data[1]))
    if kind == "bytes":
        return bytes.fromhex(data)
    if kind == "tensor":
        return tensors.pop(0).to(data[2])
    if kind == "ndarray":
        return tensors.pop(0).numpy()
    if kind == "npscalar":
        return np.dtype(data[0]).type(_value(data[1], tensors))
    if kind in ("list", "tuple"):
        items = [_value(v, tensors) for v in data]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {_value(k, tensors): _value(v, tensors) for k, v in data}
    raise ValueError(f"elastic: unknown value kind {kind!r} from the sending rank")


def _empty(spec: Any, out: list[torch.Tensor]) -> None:
    """The receive buffers for ``spec``'s tensors, in order."""
    if not isinstance(spec, dict):
        return
    (kind, data), = spec.items()
    if kind == "tensor":
        out.append(torch.empty(data[1], dtype=getattr(torch, data[0])))
    elif kind == "ndarray":
        out.append(torch.from_numpy(np.empty(data[1], dtype=np.dtype(data[0]))))
    elif kind in ("list", "tuple"):
        for v in data:
            _empty(v, out)
    elif kind == "dict":
        for k, v in data:
            _empty(k, out)
            _empty(v, out)
    elif kind == "npscalar":
        _empty(data[1], out)


def broadcast(comm: Any, value: Any = None, root: int = 0) -> Any:
    """``value`` of rank ``root`` on every rank of ``comm`` (collective; tensors come back on
    the device they were on at ``root``)."""
    tensors: list[torch.Tensor] = []
    if int(comm.rank) == root:
        text = json.dumps(_spec(value, tensors)).encode()
        head = torch.tensor([len(text)], dtype=torch.int64)
    else:
        head = torch.zeros(1, dtype=torch.int64)
    comm.broadcast(head, src=root)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8) if int(comm.rank) == root \
        else torch.empty(int(head), dtype=torch.uint8)
    comm.broadcast(data, src=root)
    spec = json.loads(bytes(data.numpy()).decode())
    if int(comm.rank) != root:
        _empty(spec, tensors)
    for t in tensors:
        if t.numel():       # as bytes: any dtype (numpy's uint32 generator state included)
            comm.broadcast(t.reshape(-1).view(torch.uint8), src=root)
    return _value(spec, list(tensors))
