"""Which optimizers a ZeroOptimizer can run on flat fp32 shards, and which it must refuse."""
from __future__ import annotations

import inspect
import warnings

import torch

#: torch optimizers whose update of each element reads only that element's gradient and state
#: (plus scalars): running them on a flat shard gives the unsharded result.
ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam", "ASGD")
    if hasattr(torch.optim, n))

#: optimizers that need a parameter's shape or the whole model, with the reason
REFUSED = {
    "LBFGS": "it re-evaluates the loss through a closure over the whole model and keeps "
             "history across all parameters",
    "Adafactor": "it factors the second moment over the rows and columns of each matrix, "
                 "which a flat shard does not have",
    "Muon": "it orthogonalises whole 2-D weight matrices, which a flat shard does not have",
    "SparseAdam": "it needs sparse gradients; the averaged shard gradient is dense",
}


def is_onebit(cls: type) -> bool:
    """Whether ``cls`` is compressed.OnebitAdam (or a subclass): run by ZeroOptimizer itself."""
    try:
        from compressed import OnebitAdam
    except ImportError:  # pragma: no cover - compressed ships with this package
        return False
    return issubclass(cls, OnebitAdam)


#: compressed optimizers ZeroOptimizer refuses, with the reason
REFUSED_COMPRESSED = {
    "ZeroOneAdam": "after var_freeze_step each rank takes local steps on its own full replica of "
                   "the weights and momentum and syncs their accumulated update every few steps; "
                   "sharded weights and state have one owner per element, so there is no local "
                   "replica to step (use compressed.ZeroOneAdam without ZeroOptimizer, or "
                   "ZeroOptimizer(compressed.OnebitAdam, ...))",
    "OnebitLamb": "its trust ratio and frozen-ratio factor need each parameter's whole weight, "
                  "update and variance norms, and its momentum scaling one norm per parameter, "
                  "while a flat shard cuts parameters across ranks (use compressed.OnebitLamb "
                  "without ZeroOptimizer, or ZeroOptimizer(compressed.OnebitAdam, ...))",
}


def _refused_compressed(cls: type) -> str | None:
    try:
        import compressed
    except ImportError:  # pragma: no cover - compressed ships with this package
        return None
    for name, why in REFUSED_COMPRESSED.items():
        if issubclass(cls, getattr(compressed, name)):
            return why
    return None


def check_inner(cls: type) -> None:
    """Raise for an optimizer class that cannot run correctly on ZeroOptimizer's flat shards."""
    why = _refused_compressed(cls)
    if why is not None:
        raise TypeError(f"ZeroOptimizer: cannot shard {cls.__name__}: {why}")
    if is_onebit(cls):
        if cls.__name__ != "OnebitAdam":
            warnings.warn(f"ZeroOptimizer: {cls.__name__} subclasses OnebitAdam; ZeroOptimizer runs "
                          "OnebitAdam's own algorithm on the shards and ignores the subclass's step()",
                          UserWarning, stacklevel=3)
        return
    for base in cls.__mro__:
        if base.__module__.startswith("torch.optim") and base.__name__ in REFUSED:
            raise TypeError(f"ZeroOptimizer: cannot shard {cls.__name__}: {REFUSED[base.__name__]}; "
                            "use an elementwise optimizer (e.g. torch.optim.AdamW) or no ZeroOptimizer")
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        params = {}
    if "comm" in params or "process_group" in params or "group" in params:
        raise TypeError(f"ZeroOptimizer: cannot shard {cls.__name__}: it communicates by itself "
                        "(it takes a communicator), so it would average different ranks' different "
                        "shards with each other")
    if not issubclass(cls, ELEMENTWISE) and getattr(cls, "elementwise", None) is not True:
        warnings.warn(f"ZeroOptimizer: {cls.__name__} is not a known elementwise optimizer; sharding "
                      "is exact only if its update of each element reads that element's gradient and "
                      "state alone (no per-tensor norms or shapes); declare it with the class "
                      "attribute elementwise = True", UserWarning, stacklevel=3)


def replay_update(inner: torch.optim.Optimizer, masters: list[torch.Tensor], states: list[dict],
                  grads: list[torch.Tensor | None], hyperparams: list[dict]) -> list[dict]:
    """Run ``inner``'s update (its class's ``step``, the same arithmetic) on other flat shards:
    group ``gi`` is ``masters[gi]`` (updated in place) with state ``states[gi]``, gradient
    ``grads[gi]`` (None: the group is left alone, as ``step`` does) and ``hyperparams[gi]``.
    ``inner`` itself is not touched (no hooks or instance attributes of it run). Returns the
    groups' states after the update (the optimizer may create state on its first update)."""
    import copy
    from collections import defaultdict

    if not (len(masters) == len(states) == len(grads) == len(hyperparams)):
        raise ValueError(f"replay_update: expected one master, state, gradient and hyperparameter dict per group, "
                         f"got {len(masters)}, {len(states)}, {len(grads)}, {len(hyperparams)}")
    rep = copy.copy(inner)          # Optimizer.__getstate__: defaults, state, param_groups only
    rep.param_groups = [{**hp, "params": [m]} for m, hp in zip(masters, hyperparams)]
    rep.state = defaultdict(dict)
    for m, st in zip(masters, states):
        if st:
            rep.state[m] = dict(st)
    for m, g in zip(masters, grads):
        m.grad = g
    try:
        type(inner).step(rep)
    finally:
        for m in masters:
            m.grad = None
    return [dict(rep.state.get(m, {})) for m in masters]
