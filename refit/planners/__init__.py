"""Planners: pure functions from (model spec, source layout, destination layout, placement) to a
`refit.plan.Plan`.  No devices, no I/O, no torch.

Contract of a planner (see `refit.planners.base.Planner`): ``plan()`` must make every element of
every destination piece arrive exactly once, from a source rank that holds the same canonical
element, and must not depend on anything but its arguments (the plan id is a hash of the output).

Every planner is one class in its own module declaring its ``name``; `PLANNERS` maps names to those
classes (``p2p``, ``broadcast``) and `register_planner` adds one, as `refit.layouts` does layouts.
"""

from refit.planners.base import Planner
from refit.planners.broadcast import BroadcastPlanner
from refit.planners.p2p import P2PPlanner
from refit.planners.registry import MIN_BUCKET_BYTES, PLANNERS, PlanResult, make_plan, register_planner

__all__ = ["Planner", "PlanResult", "PLANNERS", "P2PPlanner", "BroadcastPlanner", "make_plan", "register_planner",
           "MIN_BUCKET_BYTES"]
