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
