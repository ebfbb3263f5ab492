"""Unit tests of refit.spec: model configs, canonical tensors, and the HF tensors they stand for."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from refit.catalog import CATALOG
from refit.errors import RefitError
from refit.spec import ModelConfig, build_spec, check_tensor_table
from tests.harness.strategies import model_specs
from tests.harness.tiny import TINY_CONFIGS


def catalog_spec(name: str):
    return build_spec(name, ModelConfig.from_hf(CATALOG[name]))


@pytest.mark.parametrize("name,params,hf_tensors", [
    # parameter counts and tensor counts of the published checkpoints' safetensors indexes
    ("llama3.1-8b", 8_030_261_248, 291),
    ("qwen3-8b", 8_190_735_360, 399),
    ("qwen3-30b-moe", 30_532_122_624, 18_867),
])
def test_catalog_models_have_their_real_sizes(name, params, hf_tensors):
    spec = catalog_spec(name)
    assert spec.num_params == params
    assert spec.nbytes == 2 * params  # bf16
    assert len(list(spec.hf_tensors())) == hf_tensors


def test_qwen3_moe_canonical_shapes():
    spec = catalog_spec("qwen3-30b-moe")
    c = spec.config
    assert (c.num_experts, c.moe_intermediate_size, c.head_dim, c.qk_norm, c.qkv_bias) == (128, 768, 128, True, False)
    assert c.moe_layers == tuple(range(48)) and c.dense_layers == ()
    assert spec["model.layers.*.self_attn.q_proj.weight"].shape == (48, 32 * 128, 2048)
    assert spec["model.layers.*.self_attn.k_proj.weight"].shape == (48, 4 * 128, 2048)
    experts = spec["model.layers.*.mlp.experts.*.down_proj.weight"]
    assert experts.shape == (48, 128, 2048, 768) and experts.is_experts
    assert experts.hf_name(7, 3) == "model.layers.7.mlp.experts.3.down_proj.weight"
    assert experts.nbytes == 48 * 128 * 2048 * 768 * 2
    assert "model.layers.*.mlp.gate_proj.weight" not in spec  # no dense MLP layers


def test_sparse_step_and_mlp_only_layers_pick_the_moe_layers():
    # transformers' Qwen3MoeDecoderLayer: sparse where (l + 1) % step == 0 and l not in mlp_only_layers
    cfg = ModelConfig.from_hf({**CATALOG["qwen3-30b-moe"], "num_hidden_layers": 8, "decoder_sparse_step": 2,
                               "mlp_only_layers": [3]})
    assert cfg.moe_layers == (1, 5, 7) and cfg.dense_layers == (0, 2, 3, 4, 6)
    spec = build_spec("m", cfg)
    assert spec["model.layers.*.mlp.gate_proj.weight"].layers == (0, 2, 3, 4, 6)
    assert spec.layer_pos("model.layers.*.mlp.experts.*.up_proj.weight", 5) == 1
    # num_local_experts is what transformers 5 writes
    cfg5 = dict(CATALOG["qwen3-30b-moe"])
    cfg5["num_local_experts"] = cfg5.pop("num_experts")
    assert ModelConfig.from_hf(cfg5) == ModelConfig.from_hf(CATALOG["qwen3-30b-moe"])


def test_config_defaults_and_arch_features():
    qwen2 = ModelConfig.from_hf({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100,
                                 "intermediate_size": 128})
    assert (qwen2.num_kv_heads, qwen2.head_dim, qwen2.qkv_bias, qwen2.qk_norm, qwen2.dtype) == (2, 16, True, False,
                                                                                              "bfloat16")
    spec = build_spec("q", qwen2)
    assert spec["model.layers.*.self_attn.k_proj.bias"].shape == (2, 32)
    tied = build_spec("t", ModelConfig.from_hf({**CATALOG["qwen3-8b"], "tie_word_embeddings": True}))
    assert "lm_head.weight" not in tied and "lm_head.weight" in catalog_spec("qwen3-8b")


@pytest.mark.parametrize("change,words", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, ["unsupported model_type 'gpt2'", "GPT2LMHeadModel",
                                                                   "llama, qwen2, qwen3, qwen3_moe"]),
    ({"torch_dtype": "float64"}, ["unsupported dtype 'float64'", "bfloat16"]),
    ({"hidden_size": None}, ["lacks 'hidden_size'"]),
    ({"head_dim": None, "num_key_value_heads": None}, ["lacks 'num_key_value_heads', 'head_dim'", "write them out"]),
])
def test_bad_configs_are_refused(change, words):
    cfg = {**CATALOG["qwen3-8b"], **change}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(RefitError) as e:
        ModelConfig.from_hf(cfg)
    for w in words:
        assert w in str(e.value)


def test_digest_names_the_tensors_not_the_model_name():
    a, b = catalog_spec("qwen3-8b"), build_spec("other-name", ModelConfig.from_hf(CATALOG["qwen3-8b"]))
    assert a.digest() == b.digest() == "fbe14431564fbe49"  # stable across runs and machines
    fp32 = build_spec("x", ModelConfig.from_hf({**CATALOG["qwen3-8b"], "torch_dtype": "float32"}))
    assert fp32.digest() != a.digest()


@settings(max_examples=150, deadline=None)
@given(model_specs())
def test_hf_tensors_tile_every_canonical_tensor_exactly_once(spec):
    """Each element of each canonical tensor belongs to exactly one HF tensor, whose shape is its box's
    without the stacked dimensions."""
    count = {t.name: np.zeros(t.shape, dtype=np.int32) for t in spec.tensors}
    names = set()
    for h in spec.hf_tensors():
        assert h.name not in names and "*" not in h.name
        names.add(h.name)
        box = tuple(slice(s, s + z) for s, z in zip(h.start, h.size))
        count[h.tensor][box] += 1
        assert tuple(n for n in h.size[len(h.size) - len(h.shape):]) == h.shape
        assert np.prod(h.size) == np.prod(h.shape)
    for name, c in count.items():
        assert (c == 1).all(), name


def test_check_tensor_table_names_the_first_difference():
    expected = {"a": ((2, 3), "bfloat16"), "b": ((4,), "float32")}
    check_tensor_table(dict(expected), expected, "here")
    cases = [
        ({"a": ((2, 3), "bfloat16")}, "here: tensor 'b' is missing"),
        ({**expected, "a": ((3, 2), "bfloat16")}, "here: 'a' has shape [3, 2], expected [2, 3]"),
        ({**expected, "b": ((4,), "float16")}, "here: 'b' is float16, expected float32"),
        ({**expected, "c": ((1,), "float32"), "d": ((1,), "float32")}, "here: unexpected tensor 'c' (and 1 more)"),
    ]
    for found, message in cases:
        with pytest.raises(RefitError) as e:
            check_tensor_table(found, expected, "here")
        assert str(e.value) == message
    check_tensor_table({**expected, "c": ((1,), "float32")}, expected, "here", extra_ok=True)



# Every config.json key refit reads beyond the four it always requires.
READ_KEYS = ("num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings", "attention_bias",
             "num_experts", "num_local_experts", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
             "n_routed_experts", "first_k_dense_replace", "moe_layer_freq", "n_shared_experts",
             "num_nextn_predict_layers", "topk_method", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
             "qk_rope_head_dim", "v_head_dim", "use_qk_norm")


def _as_transformers_reads(cfg: dict) -> dict:
    """``cfg`` as transformers' config class fills it in (vLLM reads that object); Kimi-K2's
    kimi_k2 is DeepseekV3Config in vLLM's registry."""
    from transformers import AutoConfig

    rest = {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype", "dtype")}
    family = "deepseek_v3" if cfg["model_type"] == "kimi_k2" else cfg["model_type"]
    return {**AutoConfig.for_model(family, **rest).to_dict(), "model_type": cfg["model_type"],
            "torch_dtype": cfg.get("torch_dtype", "bfloat16")}


CONFIGS = {**CATALOG, **TINY_CONFIGS}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_missing_key_is_refused_or_read_as_transformers_reads_it(name):
    """Drop each key refit reads from a real config: refit either refuses the config, naming the
    key, or reads the same model transformers' config class (so vLLM) describes."""
    pytest.importorskip("transformers")
    cfg = CONFIGS[name]
    for key in READ_KEYS:
        if key not in cfg:
            continue
        dropped = {k: v for k, v in cfg.items() if k != key}
        try:
            mine = ModelConfig.from_hf(dropped)
        except RefitError as e:
            assert repr(key) in str(e), (key, str(e))
            continue
        assert mine == ModelConfig.from_hf(_as_transformers_reads(dropped)), key
