"""Property tests: for random small models and random layout pairs, running the plan moves every
destination element exactly once, from a source element of the same canonical index."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit.boxes import volume
from refit.layouts import all_holdings
from refit.plan import Plan
from refit.dtypes import DTYPE_BYTES
from refit.planners import make_plan
from tests.harness.sim import canonical_ids, check_destination, run_plan
from tests.harness.strategies import layouts, model_specs

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    spec = draw(model_specs())
    return (spec, draw(layouts(spec)), draw(layouts(spec)), draw(st.sampled_from(["colocated", "disaggregated"])),
            draw(st.sampled_from([4096, 1 << 20])))


@SETTINGS
@given(cases())
def test_p2p_moves_every_element_once(case):
    spec, src, dst, placement, bucket = case
    result = make_plan(spec, src, dst, placement, "p2p", bucket)
    canon = canonical_ids(spec)
    check_destination(spec, dst, canon, *run_plan(result.plan, spec, src, dst, canon))
    # Every byte moved lands in the destination: p2p sends nothing twice.
    s = result.summary
    assert s["local_bytes"] + s["remote_bytes"] == s["total_bytes"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_broadcast_baseline_is_correct_too(case):
    spec, src, dst, placement, bucket = case
    result = make_plan(spec, src, dst, placement, "broadcast", bucket)
    canon = canonical_ids(spec)
    check_destination(spec, dst, canon, *run_plan(result.plan, spec, src, dst, canon))
    assert result.summary["local_bytes"] + result.summary["remote_bytes"] >= result.summary["total_bytes"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plans_are_static_serialisable_and_bounded(case):
    spec, src, dst, placement, bucket = case
    a = make_plan(spec, src, dst, placement, "p2p", bucket)
    all_holdings.cache_clear()
    b = make_plan(spec, src, dst, placement, "p2p", bucket)
    assert a.plan.plan_hash == b.plan.plan_hash
    again = Plan.from_dict(json.loads(json.dumps(a.plan.to_dict())))
    assert again == a.plan and again.plan_hash == a.plan.plan_hash
    for bk in a.plan.buckets:
        ts = a.plan.transfers[bk.first:bk.first + bk.count]
        assert all((t.stage, t.sender, t.receiver) == (bk.stage, bk.sender, bk.receiver) for t in ts)
        # float32 tensors (router biases) sit beside bfloat16 ones
        assert bk.nbytes == sum(volume(t.size) * DTYPE_BYTES[spec[t.tensor].dtype] for t in ts)
        assert bk.nbytes <= bucket or bk.count == 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_same_gpu_sources_are_preferred(case):
    """Whenever a destination's own GPU holds a replica of what it needs, nothing crosses GPUs for it."""
    spec, src, dst, placement, bucket = case
    plan = make_plan(spec, src, dst, placement, "p2p", bucket).plan
    src_h = all_holdings(spec, src)
    from refit.boxes import intersect
    for t in plan.transfers:
        if plan.is_local(t):
            continue
        dgpu = plan.placement.dst_gpus[t.receiver]
        for r, gpu in enumerate(plan.placement.src_gpus):
            if gpu == dgpu:
                for box in src_h[r].get(t.tensor, ()):
                    assert not intersect(box, (t.start, t.size)), f"{t} could have come from rank {r} on the same GPU"
