"""`refit.phases`: a plan cut into layer windows moves exactly what the unphased plan moves, every
bucket inside one phase, phases in increasing key order."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit.errors import RefitError
from refit.phases import WHOLE, phase_key, phase_plan
from refit.plan import Plan, summarize
from refit.planners import make_plan
from refit.spec import ModelConfig, build_spec
from tests.harness.sim import canonical_ids, check_destination, run_plan
from tests.harness.strategies import layouts, model_specs


MOE = build_spec("tiny-moe", ModelConfig(
    arch="qwen3_moe", hidden_size=16, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=32,
    vocab_size=40, qk_norm=True, num_experts=4, moe_intermediate_size=8, moe_layers=(1, 3), dtype="bfloat16"))


@st.composite
def cases(draw):
    spec = draw(model_specs())
    return (spec, draw(layouts(spec)), draw(layouts(spec)), draw(st.sampled_from(["colocated", "disaggregated"])),
            draw(st.sampled_from([4096, 1 << 20])), draw(st.integers(1, 4)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_phased_plan_moves_the_same_elements_phase_by_phase(case):
    spec, src, dst, placement, bucket, per_phase = case
    whole = make_plan(spec, src, dst, placement, "p2p", bucket).plan
    plan = phase_plan(whole, spec, per_phase)
    canon = canonical_ids(spec)
    check_destination(spec, dst, canon, *run_plan(plan, spec, src, dst, canon))  # every element once

    assert plan.phase_layers == per_phase and plan.planner == whole.planner
    ranges = plan.phase_ranges()
    keys = [k for k, _, _ in ranges]
    assert keys == sorted(set(keys)) and len(keys) == len(plan.phases)
    assert ranges[0][1] == 0 and ranges[-1][2] == len(plan.buckets)  # contiguous and covering
    assert all(a[2] == b[1] and a[1] < a[2] for a, b in zip(ranges, ranges[1:] + [(0, ranges[-1][2], 0)]))
    covered = 0
    for key, first, end in ranges:
        for b in plan.buckets[first:end]:
            assert b.nbytes <= plan.bucket_bytes
            assert b.first == covered  # transfers of consecutive buckets are consecutive
            covered += b.count
            for t in plan.transfers[b.first:b.first + b.count]:
                rows = range(t.start[0], t.start[0] + t.size[0]) if spec[t.tensor].layers else [0]
                assert {phase_key(spec, t.tensor, r, per_phase) for r in rows} == {key}
    assert covered == len(plan.transfers)
    assert sum(b.nbytes for b in plan.buckets) == sum(b.nbytes for b in whole.buckets)

    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and again.plan_hash == plan.plan_hash and again.phase_ranges() == ranges
    assert summarize(plan, spec, 0)["num_phases"] == len(ranges)


def test_unphased_plans_are_unchanged():
    spec = MOE
    result = make_plan(spec, "megatron:tp2ep2", "vllm:tp2", "colocated", "p2p", 1 << 16)
    assert phase_plan(result.plan, spec, 0) is result.plan
    assert result.plan.phase_ranges() == [(WHOLE, 0, len(result.plan.buckets))]
    assert "phase_layers" not in result.plan.to_dict() and "num_phases" not in result.summary
    phased = make_plan(spec, "megatron:tp2ep2", "vllm:tp2", "colocated", "p2p", 1 << 16, phase_layers=1)
    assert phased.plan.plan_hash != result.plan.plan_hash and phased.summary["num_phases"] == len(phased.plan.phases)


def test_phase_keys():
    spec = MOE
    singles = [t.name for t in spec.tensors if not t.layers]
    assert [phase_key(spec, n, 0, 2) for n in singles] == list(range(len(singles)))
    stacked = next(t for t in spec.tensors if t.layers)
    m = len(singles)
    assert [phase_key(spec, stacked.name, p, 2) for p in range(len(stacked.layers))] == \
        [m + layer // 2 for layer in stacked.layers]


def test_a_gathering_plan_is_refused():
    spec = MOE
    plan = make_plan(spec, "megatron:tp2", "vllm:tp2", "colocated", "broadcast", 1 << 16).plan
    with pytest.raises(RefitError, match="broadcast plan gathers.*phase_layers=1") as e:
        phase_plan(plan, spec, 1)
    assert "\n" not in str(e.value)
