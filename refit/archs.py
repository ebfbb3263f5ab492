"""Architecture families beyond Llama/Qwen: DeepSeek-V3 (also Kimi-K2, Moonlight) and GLM-4.5.

Both are MoE models whose first ``first_k_dense_replace`` layers are dense, whose MoE layers add
``n_shared_experts`` shared experts (one MLP of width ``moe_intermediate_size * n_shared_experts``)
and a router with a float32 ``e_score_correction_bias``.  DeepSeek-V3 replaces GQA with
multi-head latent attention (MLA); GLM-4.5 keeps GQA with a qkv bias and partial rotary (rotary on
the first half of each head, which changes no tensor's shape or order).

Multi-token-prediction (MTP) layers — ``num_nextn_predict_layers`` extra decoder layers stored as
``model.layers.{num_hidden_layers + i}.*`` — are *not moved with the target*: vLLM's main model
skips them (``get_spec_layer_idx_from_weight_name``) and holds them only in its MTP drafter.  They
are not canonical tensors of the target; `ModelSpec.not_moved` names them and checkpoint checks
accept them (`refit.drafters.not_moved`, `is_not_moved`).  The drafter's own spec
(``ModelConfig.drafter == "mtp"``, `refit.drafters`) holds them, refitted into the engine's drafter
in the same version.  Nothing here imports the drafters, which build on these tensors.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from refit.errors import InvalidInput

DEEPSEEK_ARCHS = ("deepseek_v3", "kimi_k2")  # Kimi-K2 writes model_type kimi_k2 with DeepseekV3ForCausalLM
FAMILY_ARCHS = DEEPSEEK_ARCHS + ("glm4_moe",)

PerLayer = Callable[..., None]  # per_layer(suffix, shape, layers=..., dtype=...)


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if v is None:
        raise InvalidInput(f"config.json lacks {key!r} (needed for model_type {cfg.get('model_type')!r})")
    return int(v)


def family_fields(cfg: dict[str, Any], layers: int, heads: int) -> dict[str, Any]:
    """The ModelConfig fields of a DeepSeek-V3 / GLM-4.5 config.json (beyond the common ones)."""
    arch = cfg["model_type"]
    experts = int(cfg.get("n_routed_experts") or 0)
    first_dense = _int(cfg, "first_k_dense_replace", 0)
    # vLLM's DeepseekV2DecoderLayer / Glm4MoeDecoderLayer rule for which layers are sparse: only
    # DeepSeek's takes moe_layer_freq (Glm4MoeDecoderLayer, like transformers' Glm4Moe, ignores it)
    freq = int(cfg.get("moe_layer_freq", 1) or 1) if arch in DEEPSEEK_ARCHS else 1
    moe_layers = tuple(l for l in range(layers) if experts and l >= first_dense and l % freq == 0)
    out: dict[str, Any] = dict(
        num_experts=experts,
        moe_intermediate_size=_int(cfg, "moe_intermediate_size", 0),
        moe_layers=moe_layers,
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers", 1) or 0),  # transformers' default: 1
    )
    if arch in DEEPSEEK_ARCHS:
        # vLLM gives DeepseekV2MoE the float32 bias only with topk_method noaux_tc (all V3 configs)
        out["router_bias"] = cfg.get("topk_method", "noaux_tc") == "noaux_tc"
        nope, rope, v = _int(cfg, "qk_nope_head_dim"), _int(cfg, "qk_rope_head_dim"), _int(cfg, "v_head_dim")
        out.update(q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=_int(cfg, "kv_lora_rank"),
                   qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v, head_dim=nope + rope,
                   num_kv_heads=heads, qkv_bias=False, qk_norm=False)
    else:  # glm4_moe: transformers' Glm4MoeTopkRouter always has the bias
        out.update(router_bias=True, qkv_bias=bool(cfg.get("attention_bias", False)),
                   qk_norm=bool(cfg.get("use_qk_norm", False)))
    return out


def gqa_tensors(cfg: Any, per_layer: PerLayer) -> None:
    """Grouped-query attention (Llama, Qwen, GLM-4.5), HF names."""
    H, hd = cfg.hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * hd, cfg.num_kv_heads * hd
    per_layer("self_attn.q_proj.weight", (q_rows, H))
    per_layer("self_attn.k_proj.weight", (kv_rows, H))
    per_layer("self_attn.v_proj.weight", (kv_rows, H))
    if cfg.qkv_bias:
        per_layer("self_attn.q_proj.bias", (q_rows,))
        per_layer("self_attn.k_proj.bias", (kv_rows,))
        per_layer("self_attn.v_proj.bias", (kv_rows,))
    if cfg.qk_norm:
        per_layer("self_attn.q_norm.weight", (hd,))
        per_layer("self_attn.k_norm.weight", (hd,))
    per_layer("self_attn.o_proj.weight", (H, q_rows))


def mla_tensors(cfg: Any, per_layer: PerLayer) -> None:
    """The attention tensors of a DeepSeek-V3 layer (HF names), in checkpoint order."""
    H, nh = cfg.hidden_size, cfg.num_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
        per_layer("self_attn.q_a_proj.weight", (cfg.q_lora_rank, H))
        per_layer("self_attn.q_a_layernorm.weight", (cfg.q_lora_rank,))
        per_layer("self_attn.q_b_proj.weight", (nh * qk, cfg.q_lora_rank))
    else:
        per_layer("self_attn.q_proj.weight", (nh * qk, H))
    per_layer("self_attn.kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H))
    per_layer("self_attn.kv_a_layernorm.weight", (cfg.kv_lora_rank,))
    per_layer("self_attn.kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank))
    per_layer("self_attn.o_proj.weight", (H, nh * cfg.v_head_dim))


def moe_extra_tensors(cfg: Any, per_layer: PerLayer) -> None:
    """Router bias and shared experts of the MoE layers."""
    H, layers = cfg.hidden_size, cfg.moe_layers
    if cfg.router_bias:
        per_layer("mlp.gate.e_score_correction_bias", (cfg.num_experts,), layers, dtype="float32")
    if cfg.num_shared_experts:
        Is = cfg.shared_intermediate_size
        per_layer("mlp.shared_experts.gate_proj.weight", (Is, H), layers)
        per_layer("mlp.shared_experts.up_proj.weight", (Is, H), layers)
        per_layer("mlp.shared_experts.down_proj.weight", (H, Is), layers)


def mtp_layer_of(cfg: Any, name: str) -> int | None:
    """The MTP layer index (0-based) of an HF checkpoint tensor name, or None."""
    if not cfg.num_mtp_layers:
        return None
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + cfg.num_mtp_layers:
        return int(m.group(1)) - cfg.num_layers
    return None
