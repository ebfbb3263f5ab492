"""Deprecated: the planners moved to `refit.planners`.  This shim keeps ``import planners`` (and
``planners.base``, ``planners.p2p``, ``planners.broadcast``, ``planners.registry``) working for one
release, with a `DeprecationWarning`; it will then be removed.

The old names are the new objects, not copies: ``planners.base`` *is* the module
``refit.planners.base`` (so ``planners.make_plan is refit.planners.make_plan``, and what is
patched or registered through one is seen through the other).
"""

from __future__ import annotations

import sys
import warnings

warnings.warn("the top-level package `planners` is deprecated and will be removed in the next release; "
              "import `refit.planners` instead (`refit.make_plan` is the same function)",
              DeprecationWarning, stacklevel=2)

import refit.planners  # noqa: E402
import refit.planners.base  # noqa: E402
import refit.planners.broadcast  # noqa: E402
import refit.planners.p2p  # noqa: E402
import refit.planners.registry  # noqa: E402
from refit.planners import (MIN_BUCKET_BYTES, PLANNERS, BroadcastPlanner, P2PPlanner, Planner,  # noqa: E402
                            PlanResult, make_plan, register_planner)

# `import planners.base` and friends find these in sys.modules (the files live in refit/planners/).
base = refit.planners.base
broadcast = refit.planners.broadcast
p2p = refit.planners.p2p
registry = refit.planners.registry
for _name in ("base", "broadcast", "p2p", "registry"):
    sys.modules[f"{__name__}.{_name}"] = getattr(refit.planners, _name)

__all__ = ["Planner", "PlanResult", "PLANNERS", "P2PPlanner", "BroadcastPlanner", "make_plan", "register_planner",
           "MIN_BUCKET_BYTES"]
