"""DeepSeek-V3 family (MLA, Kimi-K2, Moonlight) and GLM-4.5: configs, catalog, layouts, offline round
trips bit-exact, MTP layers named as not moved, and property tests over random small models."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from refit.errors import RefitError
from refit.layouts import resolve_layout
from refit.planners import make_plan
from refit.reshard import SafetensorsWriter, rank_file
from refit.hf_checkpoint import load_spec, spec_from_dir
from refit.sides import Side
from refit.spec import ModelConfig, build_spec
from tests.harness.sim import canonical_ids, check_destination, run_plan
from tests.harness.strategies import family_specs, layouts
from tests.unit.test_reshard import assert_same_bits, load_dir, reshard
from tests.harness.tiny import TINY_CONFIGS, tiny_spec, write_hf_checkpoint


@pytest.mark.parametrize("name,params_b,moe_layers,not_moved", [
    ("deepseek-v3", 671.0, 58, 1), ("kimi-k2", 1026.4, 60, 0), ("moonlight-16b", 16.0, 26, 0),
    ("glm-4.5-air", 106.9, 45, 1), ("glm-4.5", 352.8, 89, 1),
])
def test_catalog_models(name, params_b, moe_layers, not_moved):
    spec = load_spec(name)
    assert round(spec.num_params / 1e9, 1) == params_b
    assert len(spec.config.moe_layers) == moe_layers
    assert len(spec.not_moved) == not_moved
    bias = spec["model.layers.*.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == "float32" and bias.shape == (moe_layers, spec.config.num_experts)


def test_deepseek_config_fields():
    c = ModelConfig.from_hf(TINY_CONFIGS["tiny-deepseek-v3"])
    assert c.is_mla and c.head_dim == 12 and c.q_lora_rank == 16 and c.moe_layers == (1, 2, 3)
    assert c.shared_intermediate_size == 32 and c.num_mtp_layers == 1 and c.router_bias
    m = ModelConfig.from_hf(TINY_CONFIGS["tiny-moonlight"])
    assert m.q_lora_rank == 0 and "model.layers.*.self_attn.q_proj.weight" in build_spec("m", m)
    with pytest.raises(RefitError, match="lacks 'kv_lora_rank'"):
        ModelConfig.from_hf({k: v for k, v in TINY_CONFIGS["tiny-moonlight"].items() if k != "kv_lora_rank"})


def test_moe_layer_freq_is_deepseeks_only():
    """vLLM's DeepseekV2DecoderLayer makes layer l sparse when l >= first_k_dense_replace and
    l % moe_layer_freq == 0; its Glm4MoeDecoderLayer (and transformers' Glm4Moe) ignore the field."""
    deepseek = ModelConfig.from_hf({**TINY_CONFIGS["tiny-deepseek-v3"], "num_hidden_layers": 6, "moe_layer_freq": 2})
    assert deepseek.moe_layers == (2, 4)
    glm = ModelConfig.from_hf({**TINY_CONFIGS["tiny-glm4-moe"], "num_hidden_layers": 6, "moe_layer_freq": 2})
    assert glm.moe_layers == (1, 2, 3, 4, 5)


def test_vllm_fuses_q_a_and_kv_a_and_splits_up_projections_by_heads():
    spec = tiny_spec("tiny-deepseek-v3")
    layout = resolve_layout("vllm:tp2", spec, Side.ENGINE)
    lts = {t.name: t for t in layout.local_tensors(spec, 1)}
    fused = lts["model.layers.0.self_attn.fused_qkv_a_proj.weight"]
    assert fused.shape == (16 + 16 + 4, 32)
    assert [(p.tensor.split(".")[-2], p.start[1], p.size[1], p.local_start[1]) for p in fused.pieces] == [
        ("q_a_proj", 0, 16, 0), ("kv_a_proj_with_mqa", 0, 20, 16)]
    q_b = lts["model.layers.0.self_attn.q_b_proj.weight"]
    assert q_b.shape == (2 * 12, 16) and q_b.pieces[0].start[1] == 24  # heads 2, 3
    kv_b = lts["model.layers.0.self_attn.kv_b_proj.weight"]
    assert kv_b.shape == (2 * 16, 16) and kv_b.pieces[0].start[1] == 32
    assert lts["model.layers.0.self_attn.o_proj.weight"].shape == (32, 16)
    assert lts["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "float32"
    assert lts["model.layers.1.mlp.shared_experts.gate_up_proj.weight"].shape == (32, 32)


def test_glm_vllm_layout_declares_the_router_in_the_checkpoint_dtype():
    # vLLM holds it in float32 (its loader upcasts); the layout describes what the loader is fed,
    # and the vLLM backend's landing widens it (tests/integration/test_vllm_archs.py)
    spec = tiny_spec("tiny-glm4-moe")
    lts = {lt.name: lt for lt in resolve_layout("vllm:tp2", spec, Side.ENGINE).local_tensors(spec, 1)}
    assert lts["model.layers.1.mlp.gate.weight"].dtype == "bfloat16"
    assert lts["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "float32"
    assert lts["model.layers.1.self_attn.qkv_proj.bias"].shape == ((2 + 1 + 1) * 8,)


def add_mtp_tensors(directory: str, spec) -> list[str]:
    """Append an MTP layer's tensors (as DeepSeek-V3 / GLM-4.5 checkpoints store them) in a third file."""
    L, H = spec.config.num_layers, spec.config.hidden_size
    names = {f"model.layers.{L}.enorm.weight": (H,), f"model.layers.{L}.hnorm.weight": (H,),
             f"model.layers.{L}.eh_proj.weight": (H, 2 * H), f"model.layers.{L}.shared_head.norm.weight": (H,),
             f"model.layers.{L}.mlp.experts.0.gate_proj.weight": (spec.config.moe_intermediate_size, H)}
    w = SafetensorsWriter(os.path.join(directory, "model-mtp.safetensors"),
                          [(n, s, "bfloat16") for n, s in names.items()], {"format": "pt"})
    for n, s in names.items():
        w.write(n, torch.randn(s).to(torch.bfloat16))
    w.close()
    return list(names)


CHAINS = {
    "tiny-deepseek-v3": [["megatron:tp2pp2ep4", "vllm:tp2"], ["megatron:tp4ep2etp2dp2", "vllm:tp2ep4dp2"],
                         ["fsdp:dp3", "megatron:pp3first2ep8", "vllm:tp4dp2"], ["fsdp:dp3fused1", "vllm:tp2"]],
    "tiny-moonlight": [["megatron:tp2pp3ep2", "vllm:tp4"], ["vllm:tp2ep2", "megatron:tp4ep4"]],
    "tiny-glm4-moe": [["megatron:tp2pp3ep2", "fsdp:dp2"], ["megatron:tp4ep4etp1", "megatron:tp2pp3ep2cp2"],
                      ["megatron:tp2ep2", "vllm:tp2ep2", "vllm:tp2"]],
}


@pytest.mark.parametrize("model,chain", [(m, c) for m, cs in CHAINS.items() for c in cs],
                         ids=lambda x: x if isinstance(x, str) else "-".join(x))
def test_round_trip_is_bit_exact(tmp_path, caplog, model, chain):
    src = str(tmp_path / "hf")
    spec = write_hf_checkpoint(src, model)
    mtp = add_mtp_tensors(src, spec) if spec.config.num_mtp_layers else []
    prev, prev_layout = src, "hf"
    with caplog.at_level(logging.WARNING, logger="refit.spec"):
        for i, layout in enumerate(chain + ["hf"]):
            out = str(tmp_path / f"step{i}")
            reshard(src, prev_layout, layout, prev, out)
            prev, prev_layout = out, layout
    want = {k: v for k, v in load_dir(src).items() if k not in mtp}
    assert_same_bits(want, load_dir(prev))
    if mtp:  # accepted, named as not moved, never silently dropped
        assert any("multi-token-prediction" in r.getMessage() and "not moved" in r.getMessage()
                   for r in caplog.records)


def test_router_bias_stays_float32_in_megatron_and_vllm_files(tmp_path):
    src = str(tmp_path / "hf")
    write_hf_checkpoint(src, "tiny-deepseek-v3")
    reshard(src, "hf", "megatron:tp2ep2", src, str(tmp_path / "m"))
    reshard(src, "megatron:tp2ep2", "vllm:tp2", str(tmp_path / "m"), str(tmp_path / "v"))
    with safe_open(os.path.join(src, "model-00002-of-00002.safetensors"), framework="pt") as f:
        want = f.get_tensor("model.layers.2.mlp.gate.e_score_correction_bias")
    with safe_open(rank_file(str(tmp_path / "m"), 1), framework="pt") as f:
        meg = f.get_tensor("decoder.layers.2.mlp.router.expert_bias")
    with safe_open(rank_file(str(tmp_path / "v"), 1), framework="pt") as f:
        vl = f.get_tensor("model.layers.2.mlp.gate.e_score_correction_bias")
    assert want.dtype == meg.dtype == vl.dtype == torch.float32
    assert torch.equal(want.view(torch.int32), meg.view(torch.int32)) and torch.equal(want.view(torch.int32), vl.view(torch.int32))


def test_spec_from_dir_accepts_mtp_layers_but_not_other_strays(tmp_path):
    src = str(tmp_path / "hf")
    spec = write_hf_checkpoint(src, "tiny-deepseek-v3")
    add_mtp_tensors(src, spec)
    assert spec_from_dir(src).digest() == spec.digest()
    w = SafetensorsWriter(os.path.join(src, "model-stray.safetensors"), [("model.layers.9.enorm.weight", (32,), "bfloat16")])
    w.write("model.layers.9.enorm.weight", torch.ones(32, dtype=torch.bfloat16))
    w.close()
    with pytest.raises(RefitError, match="unexpected tensor 'model.layers.9.enorm.weight'"):
        spec_from_dir(src)


@st.composite
def family_cases(draw):
    spec = draw(family_specs(draw(st.sampled_from(["deepseek_v3", "glm4_moe"]))))
    return spec, draw(layouts(spec)), draw(layouts(spec)), draw(st.sampled_from(["colocated", "disaggregated"]))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family_cases())
def test_plans_move_every_element_once_for_mla_and_glm(case):
    spec, src, dst, placement = case
    for planner in ("p2p", "broadcast"):
        result = make_plan(spec, src, dst, placement, planner, 4096)
        canon = canonical_ids(spec)
        check_destination(spec, dst, canon, *run_plan(result.plan, spec, src, dst, canon))


def test_cli_lists_the_new_models_and_says_what_is_not_moved(capsys):
    from refit.cli import main
    from refit.hf_checkpoint import hf_config

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("deepseek-v3", "kimi-k2", "moonlight-16b", "glm-4.5-air", "glm-4.5"):
        assert name in out
    assert main(["plan", "--model", "deepseek-v3", "--src", "megatron:tp8pp8ep8first5last8",
                 "--dst", "vllm:tp8ep64dp8"]) == 0
    assert "not moved: model.layers.61.*: 1 multi-token-prediction layer" in capsys.readouterr().out
    assert hf_config("deepseek-v3", load_spec("deepseek-v3"))["architectures"] == ["DeepseekV3ForCausalLM"]


def test_executor_moves_float32_biases_beside_odd_bfloat16_boxes():
    """Real processes (gloo, shared memory): a bucket holding a bfloat16 box of odd size and a
    float32 router bias must still place the bias at a 4-byte-aligned offset."""
    from tests.harness.executor_jobs import check as _check, job as _job
    from refit.bench.launch import run_job

    odd = build_spec("odd-mla", ModelConfig(
        "deepseek_v3", hidden_size=6, num_layers=3, num_heads=2, num_kv_heads=2, head_dim=4, intermediate_size=6,
        vocab_size=37, q_lora_rank=3, kv_lora_rank=5, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3,
        num_experts=4, moe_intermediate_size=2, moe_layers=(1, 2), num_shared_experts=1, router_bias=True))
    for src, dst, placement in (("megatron:tp2ep2", "vllm:tp2", "disaggregated"), ("hf", "vllm:tp2ep2", "colocated")):
        job, plans = _job(odd, src, dst, placement)
        _check(run_job(job), plans, odd)
