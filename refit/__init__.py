"""refit: weight refit / resharding for RL post-training.

Planning is pure Python (no torch): `load_spec` → `resolve_layout` → `make_plan`.  Moving bytes
lives in `refit.executor` (torch) and `refit.reshard` (offline files).
"""

from refit.errors import RefitError
from refit.layouts import parse_layout, resolve_layout
from refit.plan import Placement, Plan
from refit.spec import ModelSpec, load_spec

__version__ = "0.1.0"



def make_plan(spec, src, dst, placement="colocated", planner="p2p", bucket_bytes=256 * 2**20):  # type: ignore[no-untyped-def]
    """Plan a refit; see `planners.make_plan` (imported lazily: planners builds on refit)."""
    from planners import make_plan as _make_plan

    return _make_plan(spec, src, dst, placement, planner, bucket_bytes)



def __getattr__(name: str):  # type: ignore[no-untyped-def]
    """`refit.Client`, `refit.TrainerAgent`, `refit.EngineAgent`: imported on first use (grpc)."""
    if name in ("Client", "TrainerAgent", "EngineAgent"):
        import refit.control

        return getattr(refit.control, name)
    raise AttributeError(f"module 'refit' has no attribute {name!r}")


__all__ = ["Client", "TrainerAgent", "EngineAgent", "RefitError", "ModelSpec", "Placement", "Plan", "load_spec", "make_plan", "parse_layout", "resolve_layout"]
