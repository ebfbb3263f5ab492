"""Dtype casts on the way (`refit.casts`): which tensors a plan casts, the plan recording them
(and keeping the ids of plans that cast nothing), each side's run spec, and the refusals."""

from __future__ import annotations

import dataclasses

import pytest

from refit.casts import casts_between, describe, run_spec
from refit.errors import InvalidInput
from refit.plan import Plan
from refit.planners import make_plan
from refit.spec import ModelSpec, TensorSpec, build_spec
from tests.harness.tiny import tiny_spec


def in_dtype(spec: ModelSpec, dtype: str) -> ModelSpec:
    return build_spec(spec.name, dataclasses.replace(spec.config, dtype=dtype))


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-glm4-moe"])
def test_casts_cover_every_tensor_of_another_dtype(name: str) -> None:
    bf16 = tiny_spec(name)
    fp32 = in_dtype(bf16, "float32")
    casts = casts_between(fp32, bf16)
    assert casts == {t.name: "float32" for t in bf16.tensors if t.dtype == "bfloat16"}
    # GLM-4.5's float32 router bias is float32 on both sides: moved as it is, not cast
    assert all(bf16[n].dtype == "bfloat16" for n in casts)
    assert casts_between(bf16, bf16) == {}
    assert describe(casts, {t.name: t.dtype for t in bf16.tensors}) == {"float32->bfloat16": len(casts)}


def test_other_tensors_or_float8_are_refused() -> None:
    bf16 = tiny_spec("tiny-llama")
    other = tiny_spec("tiny-qwen2")
    with pytest.raises(InvalidInput, match="different tensors"):
        casts_between(bf16, other)
    wider = dataclasses.replace(bf16.config, intermediate_size=bf16.config.intermediate_size * 2)
    with pytest.raises(InvalidInput, match=r"'model.layers.\*.mlp.gate_proj.weight' is \[4, 128, 32\] in the trainer's, \[4, 64, 32\]"):
        casts_between(build_spec(bf16.name, wider), bf16)
    fp8 = ModelSpec(bf16.name, bf16.config, tuple(TensorSpec(t.name, t.shape, "float8_e4m3fn", t.layers)
                                                  for t in bf16.tensors))
    with pytest.raises(InvalidInput, match="float8_e4m3fn in the engine's: refit casts between bfloat16"):
        casts_between(bf16, fp8)


def test_plan_records_casts_and_plans_without_keep_their_ids() -> None:
    bf16 = tiny_spec("tiny-qwen3-moe")
    fp32 = in_dtype(bf16, "float32")
    casts = casts_between(fp32, bf16)
    plain = make_plan(bf16, "megatron:tp2", "vllm:tp2").plan
    cast = make_plan(bf16, "megatron:tp2", "vllm:tp2", casts=casts)
    assert "casts" not in plain.to_dict() and plain.casts == {}
    assert cast.plan.casts == casts and cast.plan.plan_hash != plain.plan_hash
    assert cast.summary["casts"] == {"float32->bfloat16": len(casts)}
    # the wire carries the engines' dtype: same transfers, same bytes
    assert cast.plan.transfers == plain.transfers and cast.plan.buckets == plain.buckets
    again = Plan.from_dict(cast.plan.to_dict())
    assert again.casts == casts and again.plan_hash == cast.plan.plan_hash
    bad = cast.plan.to_dict()
    bad["casts"] = [["no.such.tensor", "float32"]]
    with pytest.raises(InvalidInput, match="malformed plan: cast of no.such.tensor"):
        Plan.from_dict(bad)


def test_each_side_runs_the_plan_with_its_own_spec() -> None:
    bf16 = tiny_spec("tiny-qwen3-moe")
    fp32, fp16 = in_dtype(bf16, "float32"), in_dtype(bf16, "float16")
    plan = make_plan(bf16, "megatron:tp2", "vllm:tp2", casts=casts_between(fp32, bf16)).plan
    assert plan.spec_for(bf16, source=False) is bf16  # the engines: the plan's own spec
    wire = plan.spec_for(fp32, source=True)  # a trainer: its spec, cast tensors in the wire's dtype
    assert wire.digest() == plan.model_digest == bf16.digest()
    with pytest.raises(InvalidInput, match="casts 'model.embed_tokens.weight' from float32; this trainer holds it "
                                           "in float16"):
        plan.spec_for(fp16, source=True)
    with pytest.raises(InvalidInput, match="plan is for model"):
        plan.spec_for(fp32, source=False)
    with pytest.raises(InvalidInput, match="plan is for model"):
        run_spec(tiny_spec("tiny-llama"), {}, {}, plan.model_digest, source=True)


def test_megatron_local_tensors_follow_the_held_dtypes() -> None:
    """attach builds a trainer's spec from its live parameters: float32 tensors under a bf16 config
    (Megatron float32 masters).  The megatron layout's local tensors carry those dtypes, so the
    trainer casts them on the way (they once took the config's dtype: nothing was cast)."""
    from refit.layouts import resolve_layout

    bf16 = tiny_spec("tiny-qwen3-moe")
    held = ModelSpec(bf16.name, bf16.config, tuple(TensorSpec(t.name, t.shape, "float32", t.layers)
                                                   for t in bf16.tensors))
    layout = resolve_layout("megatron:tp2ep2", held)
    assert {lt.dtype for r in range(layout.world_size) for lt in layout.local_tensors(held, r)} == {"float32"}
    plan = make_plan(bf16, "megatron:tp2ep2", "vllm:tp2", casts=casts_between(held, bf16)).plan
    wire = plan.spec_for(held, source=True)
    assert {lt.dtype for lt in layout.local_tensors(wire, 0)} == {"bfloat16"}
