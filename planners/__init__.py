"""Planners: pure functions from (model spec, source layout, destination layout, placement) to a
`refit.plan.Plan`.  No devices, no I/O, no torch.

Contract of a planner (see `planners.base.Planner`): ``plan()`` must make every element of every
destination piece arrive exactly once, from a source rank that holds the same canonical element,
and must not depend on anything but its arguments (the plan id is a hash of the output).
"""

from planners.base import Planner
from planners.broadcast import BroadcastPlanner
from planners.p2p import P2PPlanner
from planners.registry import PLANNERS, PlanResult, make_plan

__all__ = ["Planner", "PlanResult", "PLANNERS", "P2PPlanner", "BroadcastPlanner", "make_plan"]
