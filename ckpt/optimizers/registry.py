"""Which planner serves an optimizer: the one module that knows every planner kind."""
from __future__ import annotations

import torch

from zero import ZeroOptimizer

from .base import OptimizerPlanner
from .plain import PlainPlanner
from .zero_optimizer import ZeroPlanner

#: (optimizer class, planner class), the first match wins; any other optimizer: ``PlainPlanner``.
PLANNERS: list[tuple[type, type[OptimizerPlanner]]] = [(ZeroOptimizer, ZeroPlanner)]


def planner_for(optimizer: torch.optim.Optimizer | None) -> OptimizerPlanner | None:
    """The planner for ``optimizer``'s kind (None for no optimizer)."""
    if optimizer is None:
        return None
    for kind, planner in PLANNERS:
        if isinstance(optimizer, kind):
            return planner(optimizer)
    return PlainPlanner(optimizer)
