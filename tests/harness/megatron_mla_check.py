"""Megatron-Core 0.16.1's MLA against transformers' DeepSeek-V3 attention, on the same weights (CPU).

Run as ``python -m tests.harness.megatron_mla_check '[{"q_lora_rank": 16}, ...]'`` (in a subprocess: Megatron's
parallel state is process-global; each check sets it up and tears it down).  It builds ``MLASelfAttention`` from the *local* layer spec
(``get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)``, tp 1, fake process
group), copies an HF ``DeepseekV3Attention``'s random weights into it under refit's mapping
(q_a_proj -> linear_q_down_proj, q_a_layernorm -> q_layernorm, q_b_proj -> linear_q_up_proj or
q_proj -> linear_q_proj, kv_a_proj_with_mqa -> linear_kv_down_proj, kv_a_layernorm -> kv_layernorm,
kv_b_proj -> linear_kv_up_proj, o_proj -> linear_proj) *without reordering any row*, runs both on
the same input and prints, as JSON, the largest output difference and Megatron's parameter names
and shapes.  Equal outputs mean no rope-dimension reordering exists between the two.
"""

from __future__ import annotations

import json
import sys


def _plain_core_attention():
    """Softmax attention with Megatron's core-attention interface.  The local spec's
    DotProductAttention cannot build MLA (it takes no ``k_channels``) and TE is not installed on
    this CPU machine, so this stands in for the core attention only; every projection, norm and
    the rotary embedding are Megatron's own."""
    import torch

    class PlainCoreAttention(torch.nn.Module):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None,
                     k_channels=None, v_channels=None, **_):
            super().__init__()
            self.scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, **_):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
            scores = (q @ k.transpose(-1, -2)) * self.scale
            scores = scores.masked_fill(attention_mask, float("-inf"))
            out = torch.softmax(scores, dim=-1) @ v  # [b, h, s, dv]
            b, h, s_, dv = out.shape
            return out.permute(2, 0, 1, 3).reshape(s_, b, h * dv)

    return PlainCoreAttention


def run(q_lora_rank: int | None, seq: int = 7, seed: int = 0, rope_interleave: bool = True, tp: int = 1,
        rank: int = 0) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import multi_latent_attention as mla_mod
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    H, heads, nope, rope, v, kv_lora = 32, 4, 8, 4, 8, 16
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    torch.manual_seed(seed)
    cfg = MLATransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=heads, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora,
        qk_head_dim=nope, qk_pos_emb_head_dim=rope, v_head_dim=v, rope_type="rope", rotary_base=10000,
        use_cpu_initialization=True, add_bias_linear=False, params_dtype=torch.float64, normalization="RMSNorm",
        layernorm_epsilon=1e-6, apply_rope_fusion=False, qk_layernorm=True, attention_dropout=0.0,
        hidden_dropout=0.0, bf16=False, multi_latent_attention=True, tensor_model_parallel_size=tp)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True).submodules.self_attention
    spec.submodules.core_attention = _plain_core_attention()
    mla_mod.HAVE_TE = False  # transformer_engine is half-importable here (TELinear is None)
    meg = build_module(spec, config=cfg, layer_number=1).double()
    names = [[n, list(p.shape)] for n, p in meg.named_parameters()]
    if tp > 1:  # shapes only: a fake process group moves no data
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        return {"params": names}

    hcfg = DeepseekV3Config(hidden_size=H, num_attention_heads=heads, num_key_value_heads=heads,
                            q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora, qk_nope_head_dim=nope,
                            qk_rope_head_dim=rope, v_head_dim=v, rms_norm_eps=1e-6, attention_bias=False,
                            rope_interleave=rope_interleave, max_position_embeddings=64, num_hidden_layers=1)
    hcfg._attn_implementation = "eager"
    ref = hf.DeepseekV3Attention(hcfg, layer_idx=0).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
        pairs = {"kv_a_proj_with_mqa.weight": "linear_kv_down_proj.weight",
                 "kv_a_layernorm.weight": "kv_layernorm.weight", "kv_b_proj.weight": "linear_kv_up_proj.weight",
                 "o_proj.weight": "linear_proj.weight"}
        if q_lora_rank:
            pairs.update({"q_a_proj.weight": "linear_q_down_proj.weight", "q_a_layernorm.weight": "q_layernorm.weight",
                          "q_b_proj.weight": "linear_q_up_proj.weight"})
        else:
            pairs["q_proj.weight"] = "linear_q_proj.weight"
        mp = dict(meg.named_parameters())
        for a, b in pairs.items():
            mp[b].copy_(ref.get_parameter(a))

    x = torch.randn(1, seq, H, dtype=torch.float64)
    pos = torch.arange(seq)[None]
    rot = hf.DeepseekV3RotaryEmbedding(hcfg)
    cos, sin = rot(x, pos)
    mask = torch.full((seq, seq), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        want, _ = ref(x, (cos, sin), mask)
        causal = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)  # True = masked out
        got, _ = meg(x.transpose(0, 1).contiguous(), causal)
        got = got.transpose(0, 1)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return {"max_abs_diff": float((got - want).abs().max()), "max_abs": float(want.abs().max()), "params": names}


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    cases = json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{}]  # one process, several checks
    print("REFIT_MLA_RESULT " + json.dumps([run(**c) for c in cases]), flush=True)
