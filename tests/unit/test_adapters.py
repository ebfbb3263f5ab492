"""`refit.adapters` (a LoRA adapter as a model spec: `refit.spec.adapter_spec`) and
`refit.layouts.vllm_lora` (where vLLM's LoRA slots hold it per TP rank): pure data, no torch.  The live check against vLLM loading the
adapter itself is tests/integration/test_lora_adapter.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from refit.control.common import config_json, spec_from_registration
from refit.control.config_diff import config_differences
from refit.control.registry import check_info
from refit.control.v1 import refit_pb2 as pb
from refit.errors import InvalidInput
from refit.layouts import resolve_layout
from refit.sides import Side
from refit.spec import LoraAdapter, ModelConfig, adapter_spec, build_spec

BASE = build_spec("tiny", ModelConfig(arch="qwen3", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                      head_dim=32, intermediate_size=256, vocab_size=1000, qk_norm=True))
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_spec_holds_the_adapter_only_and_survives_a_registration() -> None:
    spec = adapter_spec(BASE, 8, ["v_proj", "q_proj"], 2.0, dtype="float32")
    assert [(t.name, t.shape) for t in spec.tensors] == [
        ("model.layers.*.self_attn.q_proj.lora_A.weight", (2, 8, 128)),
        ("model.layers.*.self_attn.q_proj.lora_B.weight", (2, 128, 8)),
        ("model.layers.*.self_attn.v_proj.lora_A.weight", (2, 8, 128)),
        ("model.layers.*.self_attn.v_proj.lora_B.weight", (2, 64, 8))]
    assert spec.config.lora == LoraAdapter(8, ("q_proj", "v_proj"), 2.0)
    # what the coordinator rebuilds from the registration's JSON (refit.control.common)
    assert spec_from_registration("tiny", config_json(spec.config), spec.digest()).tensors == spec.tensors


@pytest.mark.parametrize("config", [BASE.config, adapter_spec(BASE, 8, ALL, 2.0).config,
                                    dataclasses.replace(BASE.config, moe_layers=(1,), num_experts=4)])
def test_a_config_survives_its_registration_json_exactly(config: ModelConfig) -> None:
    """``config_json`` -> ``ModelConfig.from_fields`` gives the config back, adapter and tuples included."""
    back = ModelConfig.from_fields(json.loads(config_json(config)))
    assert back == config and hash(back) == hash(config)
    assert config_json(back) == config_json(config)


def test_registrations_name_the_adapter_field_that_differs() -> None:
    a = adapter_spec(BASE, 8, ["q_proj", "v_proj"], 2.0).config
    b = adapter_spec(BASE, 16, ["q_proj", "v_proj"], 2.0).config
    assert config_differences(config_json(a), config_json(b), "trainer", "engine") == \
        "lora.rank 8 (trainer) vs 16 (engine)"
    assert config_differences(config_json(BASE.config), config_json(a), "base", "adapter") == \
        "lora.rank None (base) vs 8 (adapter); lora.scaling None vs 2.0; lora.targets None vs ['q_proj', 'v_proj']"
    assert config_differences(config_json(a), config_json(b), "a", "b", ignore=("lora.rank",)) == ""


@pytest.mark.parametrize("lora,match", [
    ({"rank": 2**15, "targets": ["q_proj"], "scaling": 1.0}, r"lora\.rank = 32768; expected an integer in \[0, 16384\]"),
    (["q_proj"], r"lora = \['q_proj'\]; expected an object"),
])
def test_a_registration_of_a_malformed_adapter_is_refused(lora: object, match: str) -> None:
    fields = json.loads(config_json(BASE.config))
    info = pb.WorkerInfo(role=pb.ROLE_TRAINER, group="g", layout="fsdp:dp1", model_name="tiny",
                         model_config_json=json.dumps({**fields, "lora": lora}))
    with pytest.raises(InvalidInput, match=match):
        check_info(info)
    with pytest.raises(InvalidInput, match="not a refit ModelConfig"):
        spec_from_registration("tiny", json.dumps({**fields, "lora": {"rank": 4, "targets": "q_proj",
                                                                       "scaling": 1.0}}), "")


@pytest.mark.parametrize("rank,targets,scaling,match", [
    (0, ALL, 1.0, "LoRA rank 0"),
    (4, ["lm_head"], 1.0, r"target modules \['lm_head'\] are none of the modules"),
    (4, ALL, float("inf"), "LoRA scaling inf"),
])
def test_refusals(rank: int, targets: list[str], scaling: float, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        adapter_spec(BASE, rank, targets, scaling)


def test_vllm_slots_per_tp_rank() -> None:
    spec = adapter_spec(BASE, 4, ALL, 2.0)
    tp4 = resolve_layout("vllm:tp4", spec, Side.ENGINE)
    for t in range(4):
        held = {lt.name: lt for lt in tp4.local_tensors(spec, t)}
        p = "model.layers.1."
        q_b = held[p + "self_attn.qkv_proj.lora_b_stacked.0"]
        k_b = held[p + "self_attn.qkv_proj.lora_b_stacked.1"]
        assert (q_b.shape, q_b.pieces[0].start) == ((32, 4), (1, 32 * t, 0))  # one q head each
        assert (k_b.shape, k_b.pieces[0].start) == ((32, 4), (1, 32 * (t // 2), 0))  # 2 kv heads replicated
        assert held[p + "self_attn.qkv_proj.lora_a_stacked.2"].shape == (4, 128)  # A whole
        o_a = held[p + "self_attn.o_proj.lora_a_stacked.0"]
        assert (o_a.shape, o_a.pieces[0].start) == ((4, 32), (1, 0, 32 * t))  # row parallel: A's columns
        assert held[p + "mlp.down_proj.lora_b_stacked.0"].shape == (128, 4)  # B whole
        up_b = held[p + "mlp.gate_up_proj.lora_b_stacked.1"]
        assert (up_b.pieces[0].tensor, up_b.pieces[0].start) == ("model.layers.*.mlp.up_proj.lora_B.weight",
                                                                  (1, 64 * t, 0))
