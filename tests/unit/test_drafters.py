"""Drafter specs and layouts (`refit.drafters`, `refit.layouts.vllm_draft`) and the trainer's attach
of a drafter (`refit.integrations.hf_draft`), without an engine: MTP layers named as DeepSeek-V3
checkpoints name them and laid out in vLLM exactly as a decoder layer of the target, plus their
own norms and ``eh_proj``; EAGLE heads named as EAGLE checkpoints name them; the tensors vLLM's
drafter shares with the target are in neither; drafters of architectures refit does not know are
refused, naming them."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit.control.common import config_json, spec_from_registration
from refit.control.config_diff import config_differences
from refit.drafters import (EAGLE, MTP, MTP_SHARED, drafter_config, eagle_canonical, eagle_config, mtp_config,
                            mtp_layers)
from refit.errors import InvalidInput
from refit.integrations.hf_draft import attach_draft
from refit.layouts import resolve_layout
from refit.layouts.vllm_draft import MTP_BLOCK, drafter_local_tensors
from refit.sides import Side
from refit.spec import ModelConfig, build_spec


def deepseek(**over: Any) -> dict[str, Any]:
    """A tiny DeepSeek-V3 config.json (the shapes of tests.harness.vllm_capture.make_models)."""
    cfg = dict(model_type="deepseek_v3", vocab_size=1000, hidden_size=128, intermediate_size=256,
               moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
               n_shared_experts=2, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
               topk_method="noaux_tc", q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
               v_head_dim=32, tie_word_embeddings=False, torch_dtype="bfloat16", num_nextn_predict_layers=1)
    cfg.update(over)
    return cfg


def llama(**over: Any) -> dict[str, Any]:
    cfg = dict(model_type="llama", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
               torch_dtype="bfloat16")
    cfg.update(over)
    return cfg


def qwen3(**over: Any) -> dict[str, Any]:
    return llama(model_type="qwen3", num_nextn_predict_layers=1, **over)


def glm(**over: Any) -> dict[str, Any]:
    """A tiny GLM-4.5 config.json (tests/harness/tiny.py's vllm-glm4-moe) with one MTP layer."""
    cfg = dict(model_type="glm4_moe", vocab_size=1000, hidden_size=128, intermediate_size=256,
               moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=64, attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5, n_shared_experts=1,
               n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, tie_word_embeddings=False,
               torch_dtype="bfloat16", num_nextn_predict_layers=1)
    cfg.update(over)
    return cfg


def normalized(lts: list, prefix: str = "") -> dict[str, tuple]:
    """Local tensors by name (``prefix`` dropped), pieces with the layer position dropped."""
    return {lt.name.replace(prefix, ""): (lt.shape, lt.dtype, tuple((p.tensor, p.start[1:], p.size[1:])
                                                                   if p.tensor.startswith("model.layers.*")
                                                                   else (p.tensor, p.start, p.size)
                                                                   for p in lt.pieces)) for lt in lts}


def covered_once_per_replica(spec: Any, layout: Any) -> None:
    """Every element of every canonical tensor is held by the tp ranks of one replica, and by
    each rank at most once."""
    tp = layout.tp
    for t in spec.tensors:
        seen = torch.zeros(t.shape, dtype=torch.int32)
        for rank in range(tp):
            mine = torch.zeros(t.shape, dtype=torch.int32)
            for lt in layout.local_tensors(spec, rank):
                for p in lt.pieces:
                    if p.tensor == t.name:
                        mine[tuple(slice(s, s + n) for s, n in zip(p.start, p.size))] += 1
            assert int(mine.max()) <= 1, f"{t.name}: rank {rank} holds an element twice"
            seen += mine
        assert int(seen.min()) >= 1, f"{t.name}: an element no rank of a replica holds"


# ------------------------------------------------------------------------------------ MTP
def test_mtp_spec_is_the_checkpoints_mtp_layer_without_what_the_target_moves() -> None:
    cfg = mtp_config(deepseek())
    assert (cfg.drafter, cfg.moe_layers, mtp_layers(cfg)) == (MTP, (2,), (2,))
    spec = build_spec("tiny-mtp", cfg)
    names = {h.name for h in spec.hf_tensors()}
    # what vLLM's DeepSeekMTP.load_weights reads from model.layers.2.* (tests/harness make_deepseek_mtp)
    assert {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight",
            "model.layers.2.shared_head.norm.weight", "model.layers.2.self_attn.q_a_proj.weight",
            "model.layers.2.self_attn.kv_b_proj.weight", "model.layers.2.mlp.gate.e_score_correction_bias",
            "model.layers.2.mlp.experts.3.down_proj.weight", "model.layers.2.mlp.shared_experts.up_proj.weight",
            "model.layers.2.input_layernorm.weight"} <= names
    assert not [n for n in names if not n.startswith("model.layers.2.")]
    assert not {f"model.layers.2.{s}" for s in MTP_SHARED} & names  # the target's in vLLM: moved by its refit
    assert spec["model.layers.*.eh_proj.weight"].shape == (1, 128, 256)
    assert spec["model.layers.*.mlp.gate.e_score_correction_bias"].dtype == "float32"
    assert "shared_head.head" in spec.not_moved[0] and "target's refit" in spec.not_moved[0]


def test_an_mtp_layer_past_the_dense_layers_rule_is_dense() -> None:
    cfg = mtp_config(deepseek(first_k_dense_replace=3))  # vLLM builds layer 2 dense
    spec = build_spec("dense-mtp", cfg)
    assert cfg.moe_layers == () and "model.layers.*.mlp.gate_proj.weight" in spec
    assert not [t for t in spec.tensors if ".experts." in t.name]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", [deepseek, glm])
def test_the_mtp_block_lies_in_vllm_as_a_decoder_layer_of_the_target(tp: int, family: Any) -> None:
    spec = build_spec("mtp", mtp_config(family()))
    layout = resolve_layout(f"vllm:tp{tp}", spec, Side.ENGINE)
    # the same model with num_hidden_layers 3: its layer 2 is built as the MTP layer's decoder
    target = build_spec("t3", ModelConfig.from_hf(family(num_hidden_layers=3, num_nextn_predict_layers=0)))
    tlayout = resolve_layout(f"vllm:tp{tp}", target, Side.ENGINE)
    for rank in range(tp):
        local = drafter_local_tensors(layout, spec, rank)
        assert local == layout.local_tensors(spec, rank)
        block = normalized([lt for lt in local if MTP_BLOCK in lt.name], MTP_BLOCK)
        layer2 = normalized([lt for lt in tlayout.local_tensors(target, rank) if lt.name.startswith("model.layers.2.")])
        assert block == layer2
        own = {lt.name: lt.shape for lt in local if MTP_BLOCK not in lt.name}
        assert own == {"model.layers.2.enorm.weight": (128,), "model.layers.2.hnorm.weight": (128,),
                       "model.layers.2.eh_proj.weight": (128, 256), "model.layers.2.shared_head.norm.weight": (128,)}
    covered_once_per_replica(spec, layout)
    assert [lt.name for lt in layout.varying_tensors(spec, 0)] == [
        "model.layers.2.mtp_block.mlp.experts.routed_experts.w13_weight",
        "model.layers.2.mtp_block.mlp.experts.routed_experts.w2_weight"]


def test_a_drafter_is_laid_out_in_hf_vllm_and_megatron_only() -> None:
    spec = build_spec("mtp", mtp_config(deepseek()))
    assert resolve_layout("hf", spec).local_tensors(spec, 0)
    with pytest.raises(InvalidInput, match=r"fsdp: a mtp drafter is laid out by refit in hf, vllm, megatron only"):
        resolve_layout("fsdp:dp2", spec)
    with pytest.raises(InvalidInput, match=r"megatron: MTP layers sit on the last pipeline stage only: their layout "
                                           r"is that stage's grid, pp 1 \(got pp 2\)"):
        resolve_layout("megatron:tp1pp2", spec)
    eagle = build_spec("eagle", eagle_config(llama()))
    with pytest.raises(InvalidInput, match=r"megatron: a eagle drafter is not a Megatron model"):
        resolve_layout("megatron:tp1", eagle)


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2), (4, 1)])
@pytest.mark.parametrize("family", [deepseek, glm])
def test_megatron_mtp_layers_lie_as_a_decoder_layer_of_the_target(tp: int, ep: int, family: Any) -> None:
    """``mtp.layers.0.transformer_layer.*`` is split as Megatron's ``decoder.layers.*`` of the same
    model one layer deeper; the norms are whole and ``eh_proj``'s rows split over tp."""
    spec = build_spec("mtp", mtp_config(family()))
    layout = resolve_layout(f"megatron:tp{tp}ep{ep}", spec)
    target = build_spec("t3", ModelConfig.from_hf(family(num_hidden_layers=3, num_nextn_predict_layers=0)))
    tlayout = resolve_layout(f"megatron:tp{tp}ep{ep}", target)
    for rank in range(layout.world_size):
        local = layout.local_tensors(spec, rank)
        block = normalized([lt for lt in local if ".transformer_layer." in lt.name], "mtp.layers.0.transformer_layer.")
        assert block == normalized([lt for lt in tlayout.local_tensors(target, rank)
                                    if lt.name.startswith("decoder.layers.2.")], "decoder.layers.2.")
        own = {lt.name: (lt.shape, [(p.start, p.size) for p in lt.pieces]) for lt in local
               if ".transformer_layer." not in lt.name}
        t, rows = rank % tp, 128 // tp
        assert own == {"mtp.layers.0.enorm.weight": ((128,), [((0, 0), (1, 128))]),
                       "mtp.layers.0.hnorm.weight": ((128,), [((0, 0), (1, 128))]),
                       "mtp.layers.0.eh_proj.weight": ((rows, 256), [((0, t * rows, 0), (1, rows, 256))]),
                       "mtp.layers.0.final_layernorm.weight": ((128,), [((0, 0), (1, 128))])}
    covered_once_per_replica(spec, layout)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from([deepseek, glm]), src=st.sampled_from(["tp1", "tp2", "tp2ep2", "tp4ep4", "tp2etp2"]),
       dst=st.sampled_from([1, 2, 4]), placement=st.sampled_from(["colocated", "disaggregated"]),
       planner=st.sampled_from(["p2p", "broadcast"]))
def test_megatron_mtp_plans_move_every_element_once_into_vllms_drafter(family: Any, src: str, dst: int,
                                                                      placement: str, planner: str) -> None:
    from refit.planners import make_plan
    from tests.harness.sim import canonical_ids, check_destination, run_plan

    spec = build_spec("mtp", mtp_config(family()))
    src_layout, dst_layout = resolve_layout(f"megatron:{src}", spec), resolve_layout(f"vllm:tp{dst}", spec, Side.ENGINE)
    result = make_plan(spec, src_layout, dst_layout, placement, planner, 4096)
    canon = canonical_ids(spec)
    check_destination(spec, dst_layout, canon, *run_plan(result.plan, spec, src_layout, dst_layout, canon))


def test_mtp_of_an_architecture_refit_does_not_describe_is_refused_naming_it() -> None:
    with pytest.raises(InvalidInput, match=r"MTP layers of model_type 'qwen3': refit lands DeepSeek-V3's and "
                                           r"GLM-4.5's \(deepseek_v3, kimi_k2, glm4_moe\)"):
        mtp_config(qwen3())
    with pytest.raises(InvalidInput, match=r"unsupported model_type 'qwen3_next'"):
        mtp_config(dict(qwen3(), model_type="qwen3_next"))
    with pytest.raises(InvalidInput, match="num_nextn_predict_layers is 0"):
        mtp_config(deepseek(num_nextn_predict_layers=0))
    with pytest.raises(InvalidInput, match=r"speculative method 'medusa'"):
        drafter_config("medusa", deepseek(), deepseek())


# ------------------------------------------------------------------------------------ EAGLE
def test_eagle_spec_is_the_heads_checkpoint_under_vllms_names() -> None:
    spec = build_spec("head", eagle_config(llama(num_hidden_layers=2)))
    assert spec.config.drafter == EAGLE
    names = [h.name for h in spec.hf_tensors()]
    assert "model.fc.weight" in names and "model.layers.1.input_layernorm.weight" in names
    assert "model.layers.0.input_layernorm.weight" not in names  # nn.Identity in vLLM's EAGLE
    assert not [n for n in names if "embed_tokens" in n or "lm_head" in n or n == "model.norm.weight"]
    assert eagle_canonical("fc.weight") == "model.fc.weight"
    assert eagle_canonical("layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert eagle_canonical("model.fc.weight") == "model.fc.weight"


@pytest.mark.parametrize("tp", [1, 2])
def test_an_eagle_layer_lies_in_vllm_as_a_llama_layer(tp: int) -> None:
    spec = build_spec("head", eagle_config(llama(num_hidden_layers=2)))
    layout = resolve_layout(f"vllm:tp{tp}", spec, Side.ENGINE)
    target = build_spec("llama2", ModelConfig.from_hf(llama(num_hidden_layers=2)))
    tlayout = resolve_layout(f"vllm:tp{tp}", target, Side.ENGINE)
    for rank in range(tp):
        local = normalized(layout.local_tensors(spec, rank))
        llama_layers = normalized([lt for lt in tlayout.local_tensors(target, rank)
                                   if lt.name.startswith("model.layers.")
                                   and lt.name != "model.layers.0.input_layernorm.weight"])
        fc = local.pop("model.fc.weight")
        assert local == llama_layers
        assert fc[0] == (128, 256)  # ReplicatedLinear: whole on every rank
    covered_once_per_replica(spec, layout)


def test_an_eagle_head_of_another_architecture_is_refused() -> None:
    with pytest.raises(InvalidInput, match=r"EAGLE head of model_type 'qwen3'"):
        eagle_config(dict(llama(), model_type="qwen3"))


# ------------------------------------------------------------------------------------ registration
def test_a_drafter_registers_and_differs_from_its_target_by_name() -> None:
    """The coordinator rebuilds a drafter's spec from its registration, and names the fields that
    set two groups apart: the drafter kind, and any shape field."""
    for cfg in (mtp_config(deepseek()), eagle_config(llama())):
        spec = build_spec("d", cfg)
        assert spec_from_registration("d", config_json(cfg), spec.digest()).tensors == spec.tensors
    target = ModelConfig.from_hf(deepseek())
    diff = config_differences(config_json(target), config_json(mtp_config(deepseek())), "trainer", "engine-draft")
    assert "drafter '' (trainer) vs 'mtp' (engine-draft)" in diff
    narrow = mtp_config(deepseek(moe_intermediate_size=32))
    diff = config_differences(config_json(narrow), config_json(mtp_config(deepseek())), "a", "b")
    assert "moe_intermediate_size 32 (a) vs 64 (b)" in diff
    assert build_spec("t", target).digest() != build_spec("d", dataclasses.replace(target, drafter=MTP,
                                                                                   moe_layers=(2,))).digest()


# ------------------------------------------------------------------------------------ trainer attach
def _random(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape).to(dtype)


def mtp_tensors() -> dict[str, torch.Tensor]:
    spec = build_spec("mtp", mtp_config(deepseek()))
    out = {h.name: _random(h.shape, getattr(torch, spec[h.tensor].dtype)) for h in spec.hf_tensors()}
    out.update({f"model.layers.2.{s}": _random((1000, 128)) for s in MTP_SHARED})  # as the checkpoint holds them
    return out


def test_attach_draft_refuses_a_tensor_that_is_no_drafters_before_registering() -> None:
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(**{k: v for k, v in deepseek().items() if k not in ("model_type", "torch_dtype")})
    stray = dict(mtp_tensors(), **{"model.layers.1.mlp.gate.weight": _random((4, 128))})
    with pytest.raises(InvalidInput, match=r"parameter 'model.layers.1.mlp.gate.weight' has no place"):
        attach_draft(stray, "127.0.0.1:1", group="draft-trainer", method="mtp", config=config)
    with pytest.raises(InvalidInput, match=r"method 'draft_model'"):
        attach_draft(mtp_tensors(), "127.0.0.1:1", group="draft-trainer", method="draft_model", config=config)


def test_attach_draft_serves_the_drafters_tensors_and_not_the_targets(server, caplog) -> None:
    from transformers import DeepseekV3Config, LlamaConfig

    _, client = server
    config = DeepseekV3Config(**{k: v for k, v in deepseek().items() if k not in ("model_type", "torch_dtype")})
    with caplog.at_level("INFO", logger="refit.integrations.hf_draft"):
        agent = attach_draft(mtp_tensors(), server[0].address, group="mtp-trainer", method="deepseek_mtp",
                             config=config)
    try:
        assert any("model.layers.2.embed_tokens.weight, model.layers.2.shared_head.head.weight not served" in r.message
                   for r in caplog.records)
        assert agent.spec.digest() == build_spec("x", mtp_config(deepseek())).digest()
    finally:
        agent.stop()
    head = torch.nn.Module()
    head.fc = torch.nn.Linear(256, 128, bias=False).to(torch.bfloat16)
    spec = build_spec("head", eagle_config(llama()))
    state = {h.name.removeprefix("model."): _random(h.shape) for h in spec.hf_tensors()}
    state["embed_tokens.weight"] = _random((1000, 128))  # a frozen copy of the target's: not served
    agent = attach_draft(state, server[0].address, group="eagle-trainer", method="eagle",
                         config=LlamaConfig(**{k: v for k, v in llama().items() if k not in ("model_type",
                                                                                             "torch_dtype")}))
    try:
        assert agent.spec.config.drafter == EAGLE and agent.spec.digest() == spec.digest()
        assert json.loads(config_json(agent.spec.config))["drafter"] == "eagle"
    finally:
        agent.stop()


# ------------------------------------------------------------------------------------ engine side
class _HF:
    def __init__(self, cfg: dict[str, Any], model: Any = None) -> None:
        self.cfg, self.model = cfg, model

    def to_dict(self) -> dict[str, Any]:
        return dict(self.cfg)


def fake_engine(method: str, target: dict[str, Any], draft: Any) -> Any:
    """What `refit.integrations.vllm.draft` reads of a vLLM engine: its configs."""
    from types import SimpleNamespace

    mc = SimpleNamespace(hf_config=_HF(target), dtype=torch.bfloat16, model="/ckpt/policy")
    dmc = SimpleNamespace(hf_config=draft, dtype=torch.bfloat16, model="/ckpt/draft")
    sc = SimpleNamespace(method=method, draft_model_config=dmc, model="/ckpt/draft")
    return SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=sc, model_config=mc))


def test_a_drafter_refit_cannot_land_is_kept_and_named(caplog) -> None:
    pytest.importorskip("vllm")
    from refit.integrations.vllm import draft
    from refit.integrations.vllm.engine import RefitInitInfo

    other = qwen3()
    assert draft.unlanded(fake_engine("mtp", deepseek(), _HF(deepseek()))) == ""
    assert draft.unlanded(fake_engine("mtp", glm(), _HF(glm()))) == ""
    assert draft.unlanded(fake_engine("eagle", llama(), _HF({"model_type": "eagle"}, _HF(llama())))) == ""
    assert "not medusa weights" in draft.unlanded(fake_engine("medusa", llama(), _HF(llama())))
    engine = fake_engine("mtp", other, _HF(other))
    with caplog.at_level("WARNING", logger="refit.integrations.vllm.draft"):
        assert draft.attach(engine, RefitInitInfo(group="engine"), None) is None
    # (this logger's records only: another test's agents may still log from their threads)
    assert [r.getMessage() for r in caplog.records if r.name == "refit.integrations.vllm.draft"] == [
        "refit: the mtp drafter /ckpt/draft is kept as loaded: MTP layers of model_type 'qwen3': refit lands "
        "DeepSeek-V3's and GLM-4.5's (deepseek_v3, kimi_k2, glm4_moe)"]


def test_an_eagle_head_with_an_embedding_of_its_own_is_refused_naming_it() -> None:
    pytest.importorskip("vllm")
    from refit.integrations.vllm.engine import DraftEngine

    head = torch.nn.Module()
    head.model = torch.nn.Module()
    head.model.fc = torch.nn.Linear(4, 2, bias=False)
    head.model.embed_tokens = torch.nn.Embedding(8, 2)
    d = DraftEngine.__new__(DraftEngine)
    d.model, d.target_params = head, frozenset({id(head.model.fc.weight)})
    d.vllm_config = fake_engine("eagle", llama(), _HF({}, _HF(llama()))).vllm_config
    with pytest.raises(InvalidInput, match=r"the eagle drafter /ckpt/draft holds model.embed_tokens.weight of its "
                                           r"own"):
        d._check_eagle_shares()
    d.target_params = frozenset({id(head.model.embed_tokens.weight)})
    d._check_eagle_shares()  # the target's embedding: shared, nothing refused
