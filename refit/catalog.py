"""Named models with their real dimensions (the fields of each model's HF config.json that
matter for sharding).  `refit models` lists them."""

from typing import Any

_QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "head_dim": 128, "tie_word_embeddings": False,
          "torch_dtype": "bfloat16"}
_QWEN3_MOE = {**_QWEN3, "model_type": "qwen3_moe", "num_experts": 128, "decoder_sparse_step": 1,
              "mlp_only_layers": []}
_LLAMA31 = {"model_type": "llama", "vocab_size": 128256, "head_dim": 128, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}

CATALOG: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-moe": {**_QWEN3_MOE, "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "intermediate_size": 6144, "moe_intermediate_size": 768},
    # Qwen/Qwen3-235B-A22B
    "qwen3-235b-moe": {**_QWEN3_MOE, "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
                       "num_key_value_heads": 4, "intermediate_size": 12288, "moe_intermediate_size": 1536},
    # Qwen/Qwen3-8B
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 12288},
    # Qwen/Qwen3-32B
    "qwen3-32b": {**_QWEN3, "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "intermediate_size": 25600},
    # meta-llama/Llama-3.1-8B
    "llama3.1-8b": {**_LLAMA31, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "intermediate_size": 14336},
    # meta-llama/Llama-3.1-70B
    "llama3.1-70b": {**_LLAMA31, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                     "num_key_value_heads": 8, "intermediate_size": 28672},
}

# DeepSeek-V3 family (model_type deepseek_v3; Kimi-K2's config says kimi_k2 with DeepseekV3ForCausalLM).
# The released DeepSeek-V3/Kimi-K2 weights are block-quantised fp8/int4; these entries describe the
# bfloat16 model an RL trainer holds.  Values from each model's config.json on the HF hub
# (deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct, moonshotai/Moonlight-16B-A3B), cross-checked
# against slime's scripts/models/moonlight.sh and Megatron-Bridge's docs.
_DSV3 = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
         "num_hidden_layers": 61, "intermediate_size": 18432, "moe_intermediate_size": 2048,
         "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
         "v_head_dim": 128, "n_shared_experts": 1, "moe_layer_freq": 1, "topk_method": "noaux_tc",
         "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# GLM-4.5 family (model_type glm4_moe): zai-org/GLM-4.5 and zai-org/GLM-4.5-Air config.json, cross-checked
# against slime's scripts/models/glm4.5-355B-A32B.sh / glm4.5-106B-A12B.sh and Megatron-Bridge's glm45.md.
_GLM45 = {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "vocab_size": 151552,
          "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "attention_bias": True,
          "partial_rotary_factor": 0.5, "n_shared_experts": 1, "num_nextn_predict_layers": 1,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

CATALOG.update({
    # deepseek-ai/DeepSeek-V3 (671B)
    "deepseek-v3": {**_DSV3, "vocab_size": 129280, "num_attention_heads": 128, "num_key_value_heads": 128,
                    "n_routed_experts": 256, "first_k_dense_replace": 3, "num_nextn_predict_layers": 1},
    # moonshotai/Kimi-K2-Instruct (1T)
    "kimi-k2": {**_DSV3, "model_type": "kimi_k2", "vocab_size": 163840, "num_attention_heads": 64,
                "num_key_value_heads": 64, "n_routed_experts": 384, "first_k_dense_replace": 1,
                "num_nextn_predict_layers": 0},
    # moonshotai/Moonlight-16B-A3B: no q LoRA (a plain q_proj), 2 shared experts
    "moonlight-16b": {**_DSV3, "vocab_size": 163840, "hidden_size": 2048, "num_hidden_layers": 27,
                      "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 11264,
                      "moe_intermediate_size": 1408, "q_lora_rank": None, "n_routed_experts": 64,
                      "n_shared_experts": 2, "first_k_dense_replace": 1, "num_nextn_predict_layers": 0},
    # zai-org/GLM-4.5-Air (106B): no qk norm
    "glm-4.5-air": {**_GLM45, "hidden_size": 4096, "num_hidden_layers": 46, "intermediate_size": 10944,
                    "moe_intermediate_size": 1408, "n_routed_experts": 128, "first_k_dense_replace": 1,
                    "use_qk_norm": False},
    # zai-org/GLM-4.5 (355B): qk norm
    "glm-4.5": {**_GLM45, "hidden_size": 5120, "num_hidden_layers": 92, "intermediate_size": 12288,
                "moe_intermediate_size": 1536, "n_routed_experts": 160, "first_k_dense_replace": 3,
                "use_qk_norm": True},
})
