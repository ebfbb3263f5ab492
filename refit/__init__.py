"""refit: weight refit / resharding for RL post-training.

Planning is pure Python (no torch): `load_spec` → `resolve_layout` → `make_plan`.  Moving bytes
lives in `refit.executor` (torch) and `refit.reshard` (offline files).

The flow, each layer importing only those before it:
``refit.errors, refit.dtypes, refit.boxes`` → ``refit.spec`` (model) → ``refit.hf_checkpoint``
(models on disk) → ``refit.layouts`` → ``refit.plan`` (plan data) → ``refit.planners`` (which
compute plans) → ``refit.reshard``, ``refit.executor``, ``refit.control``, ``refit.cli``.
"""

from __future__ import annotations

from typing import Any

from refit.errors import InvalidInput, RefitError, RefitFailed
from refit.hf_checkpoint import load_spec
from refit.layouts import Layout, parse_layout, resolve_layout
from refit.plan import DEFAULT_BUCKET_BYTES, Placement, Plan
from refit.planners import PlanResult, make_plan
from refit.sides import Side  # resolve_layout's role
from refit.spec import ModelSpec

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`refit.Client`, `refit.TrainerAgent`, `refit.EngineAgent` (grpc) and `refit.load_plan`
    (pydantic): imported on first use."""
    if name in ("Client", "TrainerAgent", "EngineAgent"):
        import refit.control

        return getattr(refit.control, name)
    if name == "load_plan":
        from refit.plan_schema import load_plan

        return load_plan
    raise AttributeError(f"module 'refit' has no attribute {name!r}")


__all__ = ["Client", "TrainerAgent", "EngineAgent", "RefitError", "InvalidInput", "RefitFailed", "ModelSpec", "Layout",
           "Placement", "Plan", "PlanResult", "DEFAULT_BUCKET_BYTES", "load_plan", "load_spec", "make_plan", "parse_layout",
           "resolve_layout", "Side"]
