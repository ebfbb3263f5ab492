"""Build tiny, random-weight HF checkpoints for vLLM ground-truth tests.

Every parameter (including norms and biases) is re-initialised with
``torch.randn * 0.02`` from a seeded generator, so nothing is zero/one and
padding or mis-placed shards are easy to spot.  Weights are saved as bfloat16
safetensors via ``save_pretrained(..., safe_serialization=True)``.

vLLM is started with ``skip_tokenizer_init=True`` so no real tokenizer is
needed; we still write a minimal ``generation_config.json`` (and nothing that
would make vLLM/transformers try to download a tokenizer).
"""

from __future__ import annotations

import json
import os

import torch

# Vocab deliberately NOT a multiple of 64 so vLLM's vocab padding shows up.
TINY_VOCAB = 1000


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for _name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.copy_((torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02).to(p.dtype))


def _save(model, cfg, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    # Minimal generation config; no tokenizer files (skip_tokenizer_init=True).
    gen_cfg = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen_cfg, f)


def make_tiny_qwen3_moe(dir: str, seed: int = 0, num_experts: int = 4, num_attention_heads: int = 4,  # noqa: A002
                        num_key_value_heads: int = 2, head_dim: int = 64) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,  # unused (no mlp_only_layers) but keep small
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        num_experts=num_experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    _randomize_(model, seed)
    _save(model, cfg, dir)


def make_tiny_qwen3_moe_e7(dir: str, seed: int = 0) -> None:  # noqa: A002 (API name)
    """A Qwen3-MoE of 7 experts: no expert-parallel size above 1 divides it (ep2 places 4 + 3,
    ep4 2 + 2 + 2 + 1), so vLLM's placement of the remainder shows; 2 kv heads, so tp4 replicates
    them."""
    make_tiny_qwen3_moe(dir, seed, num_experts=7)


def make_tiny_qwen3_moe_kv4(dir: str, seed: int = 0) -> None:  # noqa: A002 (API name)
    """The headline ``qwen3-30b-moe -> vllm:tp8`` in small: 4 kv heads (each on two ranks of tp8),
    16 q heads of head_dim 32 (two a rank), and 12 experts (ep8 places 2,2,2,2,1,1,1,1;
    moe_intermediate 64 splits 8 ways without expert parallel)."""
    make_tiny_qwen3_moe(dir, seed, num_experts=12, num_attention_heads=16, num_key_value_heads=4, head_dim=32)


def make_tiny_qwen3(dir: str, seed: int = 0) -> None:  # noqa: A002 (API name)
    """A dense Qwen3 (qk-norm, no qkv bias, untied head)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    _randomize_(model, seed)
    _save(model, cfg, dir)


def make_tiny_qwen2(dir: str, seed: int = 0) -> None:  # noqa: A002 (API name)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # NOTE: vLLM 0.32's Qwen2Attention ignores config.head_dim and uses
    # hidden_size // num_attention_heads (vllm/model_executor/models/qwen2.py),
    # so hidden_size must equal num_heads * head_dim = 4 * 64 = 256 here.
    # (With hidden 128 + head_dim 64, vLLM would silently load a wrong slice.)
    cfg = Qwen2Config(
        vocab_size=TINY_VOCAB,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    _randomize_(model, seed)
    _save(model, cfg, dir)


def make_tiny_deepseek_v3(dir: str, seed: int = 0, q_lora_rank: int | None = 64) -> None:  # noqa: A002
    """DeepSeek-V3 (MLA) small in every dimension vLLM's CPU MLA backend allows: kv_lora_rank 512 and
    qk_rope_head_dim 64 are what it supports.  Layer 0 dense, layer 1 MoE with 2 shared experts.
    ``e_score_correction_bias`` stays float32 (transformers' ``_keep_in_fp32_modules_strict``; the
    released DeepSeek-V3 checkpoints store it as F32) and gets random values."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        topk_method="noaux_tc",  # as in DeepSeek-V3's config.json; without it vLLM builds no bias
        q_lora_rank=q_lora_rank, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    _randomize_(model, seed)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    with torch.no_grad():
        for name, mod in sorted(model.named_modules()):
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias = torch.randn(cfg.n_routed_experts, generator=gen, dtype=torch.float32)
    _save(model, cfg, dir)


def make_tiny_moonlight(dir: str, seed: int = 0) -> None:  # noqa: A002
    """Moonlight-style DeepSeek-V3: no q LoRA (a plain ``q_proj``)."""
    make_tiny_deepseek_v3(dir, seed, q_lora_rank=None)


def make_tiny_glm4_moe(dir: str, seed: int = 0) -> None:  # noqa: A002
    """GLM-4.5 (``vllm-glm4-moe`` of tests/harness/tiny.py, written by refit's own writer): qkv
    bias, partial rotary, a dense first layer, a shared expert, a float32 router bias."""
    from tests.harness.tiny import write_hf_checkpoint

    write_hf_checkpoint(dir, "vllm-glm4-moe", seed=seed, scale=0.02)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    makers = {"qwen3_moe": make_tiny_qwen3_moe, "qwen3_moe_e7": make_tiny_qwen3_moe_e7,
              "qwen3_moe_kv4": make_tiny_qwen3_moe_kv4, "qwen3": make_tiny_qwen3, "qwen2": make_tiny_qwen2}
    ap.add_argument("kind", choices=sorted(makers))
    ap.add_argument("dir")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    makers[a.kind](a.dir, a.seed)
