"""Everything ckpt knows about optimizers: one planner per optimizer kind behind one interface.

What lives where:
    base            ``OptimizerPlanner``, what ``save`` and ``load`` ask of an optimizer, and the
                    per-parameter state helpers (scalars, per-element tensors)
    plain           ``PlainPlanner``: a plain torch optimizer (replicated state, extras included)
    zero_optimizer  ``ZeroPlanner``: a ``zero.ZeroOptimizer`` (sharded masters and state)
    registry        ``planner_for``: which planner serves an optimizer (the only module that
                    imports every planner)
"""
from .base import OptimizerPlanner, SavedOptimizer
from .plain import PlainPlanner
from .registry import PLANNERS, planner_for
from .zero_optimizer import ZeroPlanner

__all__ = ["OptimizerPlanner", "PLANNERS", "PlainPlanner", "SavedOptimizer", "ZeroPlanner", "planner_for"]
