"""Which optimizer planner serves an optimizer: the one module that knows every planner kind.

``planner`` defines the interface (``OptimizerPlanner``) and imports no planner; ``planner_plain``
and ``planner_zero`` implement it; this module picks one, so no module imports one that
imports it back.
"""
from __future__ import annotations

import torch

from zero import ZeroOptimizer

from .planner import OptimizerPlanner
from .planner_plain import PlainPlanner
from .planner_zero import ZeroPlanner

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
