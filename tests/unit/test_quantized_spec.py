"""Quantized engines as data: the FP8 spec (weights in float8, a block-scale tensor beside each),
every layout over it (`refit.layouts.quantized`), the refusals of shards that cut 128-blocks, and
plans that record the quantization the trainers do on the way."""

from __future__ import annotations

import dataclasses

import pytest

from refit.errors import InvalidInput
from refit.layouts import QuantizedLayout, resolve_layout
from refit.plan import Plan
from refit.planners import make_plan
from refit.quantization import is_quantized
from refit.sides import Side
from refit.spec import ModelConfig, base_spec, build_spec, quantize_spec

# A Qwen3-MoE whose linear weights split into whole 128-blocks at tp2 (q, k and v 256 rows each,
# experts 256 wide, hidden 256): small, but the shapes FP8 engines need.
CONFIG = {"model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 512, "moe_intermediate_size": 256,
          "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128, "torch_dtype": "bfloat16"}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def spec(**changes: object):
    return build_spec("q", ModelConfig.from_hf({**CONFIG, **changes}))


def test_fp8_spec_quantizes_the_linear_weights_and_adds_their_scales() -> None:
    base = spec()
    q = quantize_spec(base, "fp8")
    assert base_spec(q) == base and q.digest() != base.digest()
    assert build_spec("q", ModelConfig.from_hf({**CONFIG, "quantization_config": FP8})) == q
    names = {t.name: t for t in q.tensors}
    for t in base.tensors:
        if not is_quantized(t.name):  # embeddings, norms, the router: as they were
            assert names[t.name] == t
            continue
        assert names[t.name].dtype == "float8_e4m3fn" and names[t.name].shape == t.shape
        scale = names[t.name + "_scale_inv"]
        assert scale.dtype == "float32" and scale.layers == t.layers
        assert scale.shape == t.shape[:-2] + (-(-t.shape[-2] // 128), -(-t.shape[-1] // 128))
    assert {n for n in names if n.endswith("_scale_inv")} >= {"model.layers.*.mlp.experts.*.gate_proj.weight_scale_inv",
                                                             "model.layers.*.self_attn.q_proj.weight_scale_inv"}
    assert not is_quantized("model.layers.*.mlp.gate.weight") and not is_quantized("lm_head.weight")


def test_checkpoints_in_other_formats_are_refused_naming_them() -> None:
    with pytest.raises(InvalidInput, match="awq"):
        ModelConfig.from_hf({**CONFIG, "quantization_config": {"quant_method": "awq", "bits": 4}})
    with pytest.raises(InvalidInput, match="weight_block_size"):
        ModelConfig.from_hf({**CONFIG, "quantization_config": {**FP8, "weight_block_size": [64, 64]}})
    with pytest.raises(InvalidInput, match="already quantized"):
        quantize_spec(quantize_spec(spec(), "fp8"), "fp8")
    with pytest.raises(InvalidInput, match="unknown quantization"):
        quantize_spec(spec(), "nvfp4")


def test_vllm_rank_holds_scales_beside_its_fused_weights() -> None:
    q = quantize_spec(spec(), "fp8")
    layout = resolve_layout("vllm:tp2", q, Side.ENGINE)
    assert isinstance(layout, QuantizedLayout) and layout.describe() == "vllm:tp2" and layout.world_size == 2
    by_name = {lt.name: lt for lt in layout.local_tensors(q, 1)}
    qkv = by_name["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.dtype == "float8_e4m3fn" and qkv.shape == (384, 256)  # q, k, v: 128 rows each per rank
    scale = by_name["model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
    assert scale.shape == (3, 2) and scale.dtype == "float32"
    assert [(p.tensor.rsplit(".", 2)[-2], p.start, p.size, p.local_start) for p in scale.pieces] == \
        [("q_proj", (0, 1, 0), (1, 1, 2), (0, 0, 0)), ("k_proj", (0, 1, 0), (1, 1, 2), (0, 1, 0)),
         ("v_proj", (0, 1, 0), (1, 1, 2), (0, 2, 0))]
    w13 = by_name["model.layers.0.mlp.experts.routed_experts.w13_weight_scale_inv"]
    assert w13.shape == (4, 2, 2)  # gate's then up's 128 rows of each expert
    assert "model.layers.0.mlp.gate.weight_scale_inv" not in by_name  # the router stays bfloat16
    assert by_name["model.layers.0.mlp.gate.weight"].dtype == "bfloat16"


def test_shards_that_cut_blocks_are_refused_with_the_numbers() -> None:
    q = quantize_spec(spec(num_attention_heads=4), "fp8")
    with pytest.raises(InvalidInput, match=r"vllm:tp4 rank 0: model.layers.0.mlp.experts.routed_experts.w13_weight "
                                           r"holds rows \[0, 64\) of model.layers.\*.mlp.experts.\*.gate_proj.weight "
                                           r"\(256 rows\) at rows \[0, 64\) of its 128: that cuts fp8's blocks of "
                                           r"128 rows"):
        make_plan(q, "megatron:tp1", "vllm:tp4")
    small_heads = quantize_spec(spec(num_attention_heads=4, num_key_value_heads=4, head_dim=64), "fp8")
    # a trainer's shard may cut blocks (Megatron interleaves q, k, v per query group, 64 rows each
    # here): its blocks' scales are shared across the rows' holders (tests/unit/test_shared_blocks.py)
    trainer = make_plan(small_heads, "megatron:tp1", "vllm:tp1").src
    shared = [sb.source for sb in trainer.shared_blocks(small_heads, 0)]
    assert shared[:1] == ["decoder.layers.0.self_attention.linear_qkv.weight"]


def test_plan_records_the_quantization_and_moves_about_half_the_bytes() -> None:
    base = spec()
    q = quantize_spec(base, "fp8")
    plain, quant = make_plan(base, "megatron:tp2", "vllm:tp2"), make_plan(q, "megatron:tp2", "vllm:tp2")
    assert quant.plan.quantization == ("fp8", "bfloat16") and not plain.plan.quantization
    assert "quantization" not in plain.plan.to_dict()  # unquantized plans keep their ids
    again = Plan.from_dict(quant.plan.to_dict())
    assert again == quant.plan and again.plan_hash == quant.plan.plan_hash
    s = quant.summary["quantization"]
    assert s["format"] == "fp8" and s["bytes"] == q.nbytes and s["unquantized_bytes"] == base.nbytes
    linear = sum(t.nbytes for t in base.tensors if is_quantized(t.name))
    assert quant.summary["total_bytes"] == plain.summary["total_bytes"] - linear // 2 + \
        sum(t.nbytes for t in q.tensors if t.name.endswith("_scale_inv"))
    bad = {**quant.plan.to_dict(), "quantization": ["fp4", "bfloat16"]}
    with pytest.raises(InvalidInput, match="malformed plan: quantization"):
        Plan.from_dict(bad)


def test_each_side_runs_a_quantized_plan_with_its_own_spec() -> None:
    """The engine runs it with the FP8 spec it holds; a trainer holding bfloat16 (or float32
    masters, cast first) with that spec too, once it quantizes; any other model is refused."""
    base = spec()
    q = quantize_spec(base, "fp8")
    plan = make_plan(q, "megatron:tp2", "vllm:tp2").plan
    assert plan.spec_for(q, source=False) is q
    assert plan.spec_for(base, source=True).digest() == q.digest()
    fp32 = build_spec("q", dataclasses.replace(base.config, dtype="float32"))
    from refit.casts import casts_between

    casts = casts_between(fp32, q)
    assert set(casts) == {t.name for t in base.tensors} and set(casts.values()) == {"float32"}
    cast_plan = make_plan(q, "megatron:tp2", "vllm:tp2", casts=casts).plan
    assert cast_plan.spec_for(fp32, source=True).digest() == q.digest()
    with pytest.raises(InvalidInput, match="plan is for model"):
        plan.spec_for(spec(vocab_size=256), source=True)
    with pytest.raises(InvalidInput, match="trainer's model is quantized"):
        casts_between(q, q)


def test_mxfp8_blocks_are_32_columns_with_byte_scales() -> None:
    q = quantize_spec(spec(), "mxfp8")
    assert q["model.layers.*.self_attn.q_proj.weight_scale"].shape == (2, 256, 8)
    assert q["model.layers.*.self_attn.q_proj.weight_scale"].dtype == "uint8"
    plan = make_plan(q, "megatron:tp2", "vllm:tp2")
    assert plan.plan.quantization == ("mxfp8", "bfloat16")
    with pytest.raises(InvalidInput, match="refit writes no mxfp8 checkpoints"):
        from refit.quantization import hf_quantization_config

        hf_quantization_config("mxfp8", ())
    odd = quantize_spec(spec(hidden_size=240), "mxfp8")  # 240 columns: no whole 32-blocks
    with pytest.raises(InvalidInput, match="240 columns: mxfp8 needs a multiple of 32"):
        make_plan(odd, "megatron:tp1", "vllm:tp1")
