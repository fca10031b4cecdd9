"""The models the bench programs train: a stack of Linear layers (with or without activations)
and a stack of transformer encoder blocks. The same seed builds the same weights."""
from __future__ import annotations

__all__ = ["mlp", "transformer", "param_count"]

_ACTIVATIONS = ("gelu", "tanh", None)


def mlp(hidden: int, layers: int, *, activation: str | None = None, last_activation: bool = True,
        seed: int | None = 0):
    """``layers`` x Linear(hidden, hidden), each followed by ``activation`` (``gelu``, ``tanh`` or
    None), the last one too unless ``last_activation=False``. ``seed=None``: weights left
    uninitialised (built on the meta device, then given memory), for loading into."""
    import torch

    if activation not in _ACTIVATIONS:
        raise ValueError(f"mlp: expected activation in {_ACTIVATIONS}, got {activation!r}")

    def build():
        mods = []
        for _ in range(layers):
            mods.append(torch.nn.Linear(hidden, hidden))
            if activation == "gelu":
                mods.append(torch.nn.GELU())
            elif activation == "tanh":
                mods.append(torch.nn.Tanh())
        if activation is not None and not last_activation:
            mods.pop()
        return torch.nn.Sequential(*mods)

    if seed is None:
        with torch.device("meta"):
            model = build()
        return model.to_empty(device="cpu")
    torch.manual_seed(seed)
    return build()


def transformer(hidden: int, layers: int, heads: int, *, seed: int = 0):
    """``layers`` encoder blocks of width ``hidden``, ``heads`` heads, feed-forward 4 x hidden."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(*[
        torch.nn.TransformerEncoderLayer(hidden, heads, dim_feedforward=4 * hidden, dropout=0.0,
                                         batch_first=True) for _ in range(layers)])


def param_count(model) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())
