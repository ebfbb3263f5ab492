"""The planners by name, and `make_plan`: resolve both layouts, plan, summarise.

Every planner is one class in its own module declaring its ``name``; `PLANNERS` maps names to
those classes (as `refit.layouts.LAYOUTS` does frameworks), and `register_planner` adds one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from dataclasses import dataclass
from typing import Any, Iterator

from refit.casts import Casts
from refit.casts import describe as describe_casts
from refit.errors import InvalidInput
from refit.layouts import Layout, all_holdings, resolve_layout
from refit.phases import phase_plan
from refit.plan import DEFAULT_BUCKET_BYTES, Placement, Plan, summarize
from refit.planners.base import Planner, total_bytes
from refit.planners.broadcast import BroadcastPlanner
from refit.planners.p2p import P2PPlanner
from refit.sides import Side
from refit.spec import ModelSpec, base_spec

# planner name -> planner class (in the order errors list them)
PLANNERS: dict[str, type[Planner]] = {}
MIN_BUCKET_BYTES = 4096


def register_planner(cls: type[Planner]) -> type[Planner]:
    """Add a planner class to the registry (its ``name`` must be new)."""
    if cls.name in PLANNERS:
        raise ValueError(f"a planner named {cls.name!r} is already registered: {PLANNERS[cls.name]}")
    PLANNERS[cls.name] = cls
    return cls


for _builtin in (P2PPlanner, BroadcastPlanner):
    register_planner(_builtin)


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    summary: dict[str, Any]
    src: Layout
    dst: Layout


def make_plan(spec: ModelSpec, src: str | Layout, dst: str | Layout, placement: str = "colocated",
              planner: str = "p2p", bucket_bytes: int = DEFAULT_BUCKET_BYTES, phase_layers: int = 0,
              casts: Casts | None = None) -> PlanResult:
    """Resolve both layouts, plan, and summarise — the whole of `refit plan`.  ``phase_layers``
    > 0: the plan cut into phases of that many layers (`refit.phases.phase_plan`).  ``casts``:
    the trainers hold these tensors of ``spec`` (the engines' spec) in other dtypes
    (`refit.casts.casts_between`); the plan records them.  Raises
    `refit.InvalidInput` for layouts, a planner or a bucket size that cannot serve; pure: no I/O."""
    if planner not in PLANNERS:
        raise InvalidInput(f"unknown planner {planner!r}: {', '.join(PLANNERS)}")
    if bucket_bytes < MIN_BUCKET_BYTES:
        raise InvalidInput(f"bucket size {bucket_bytes} bytes is too small (at least {MIN_BUCKET_BYTES})")
    t0 = time.perf_counter()
    with _gc_paused():
        src_l = resolve_layout(src, spec, Side.TRAINER)
        dst_l = resolve_layout(dst, spec, Side.ENGINE)
        place = Placement.make(placement, src_l.world_size, dst_l.world_size)
        plan = phase_plan(PLANNERS[planner]().plan(spec, src_l, dst_l, place, bucket_bytes), spec, phase_layers)
        if casts:
            plan = dataclasses.replace(plan, casts=dict(casts))
        if spec.config.quantization:  # the trainers quantize what they send (`refit.quantization`)
            plan = dataclasses.replace(plan, quantization=(spec.config.quantization, spec.config.dtype))
        seconds = time.perf_counter() - t0
        dst_total = total_bytes(spec, all_holdings(spec, dst_l))
        summary = summarize(plan, spec, dst_total, seconds)
        if casts:
            summary["casts"] = describe_casts(casts, {t.name: t.dtype for t in base_spec(spec).tensors})
        if spec.config.quantization:
            summary["quantization"] = quantization_summary(spec)
        if spec.not_moved:  # e.g. DeepSeek-V3's MTP layers: said, never silently dropped
            summary["not_moved"] = list(spec.not_moved)
        return PlanResult(plan, summary, src_l, dst_l)


def quantization_summary(spec: ModelSpec) -> dict[str, Any]:
    """What a quantized plan's engines hold: the format, how many weights, and their bytes against
    the same weights unquantized (what a refit of the unquantized model would move)."""
    base = {t.name: t for t in base_spec(spec).tensors}
    quantized = [t for t in spec.tensors if t.name in base and t.dtype != base[t.name].dtype]
    return {"format": spec.config.quantization, "from": spec.config.dtype, "tensors": len(quantized),
            "bytes": spec.nbytes, "unquantized_bytes": sum(t.nbytes for t in base.values())}


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Planning allocates ~10^6 tuples and no reference cycles; the cyclic GC's passes over them
    cost 15-40% of planning time and free nothing.  On the way out the objects still alive (the
    plan's 10^5 transfers, mostly) move straight to the oldest generation (`gc.freeze` then
    `gc.unfreeze`): they live as long as the plan, and a young-generation pass over all of them
    when the GC is enabled again took another 10%."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()
