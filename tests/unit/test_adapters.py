"""`refit.adapters` (a LoRA adapter as a model spec: `refit.spec.adapter_spec`) and
`refit.layouts.vllm_lora` (where vLLM's LoRA slots hold it per TP rank): pure data, no torch.  The live check against vLLM loading the
adapter itself is tests/integration/test_lora_adapter.py."""

from __future__ import annotations

import json
import dataclasses

import pytest

from refit.errors import InvalidInput
from refit.layouts import resolve_layout
from refit.spec import ModelConfig, adapter_spec, build_spec

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
    # what the coordinator rebuilds from the registration's JSON (refit.control.common)
    fields = json.loads(json.dumps(dataclasses.asdict(spec.config)))
    fields["moe_layers"] = tuple(fields["moe_layers"])
    assert build_spec("tiny", ModelConfig(**fields)).digest() == spec.digest()


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
    tp4 = resolve_layout("vllm:tp4", spec, "dst")
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
