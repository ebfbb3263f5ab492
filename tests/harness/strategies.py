"""Hypothesis strategies: small random models and layouts that can split them."""

from __future__ import annotations

from hypothesis import strategies as st

from refit.layouts import FsdpLayout, HFLayout, MegatronLayout, VllmLayout
from refit.spec import ModelConfig, ModelSpec, build_spec


def divisors(n: int, limit: int = 8) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


@st.composite
def family_specs(draw, arch: str) -> ModelSpec:
    """DeepSeek-V3 (MLA, with or without q LoRA) or GLM-4.5 (GQA + qkv bias): dense first layers,
    routed + shared experts, float32 router bias, MTP layers (not canonical)."""
    layers = draw(st.integers(1, 5))
    first_dense = draw(st.integers(0, layers))
    heads = draw(st.sampled_from([1, 2, 3, 4]))
    common = dict(
        hidden_size=draw(st.sampled_from([4, 8, 12])), num_layers=layers, num_heads=heads,
        intermediate_size=draw(st.sampled_from([8, 12, 24])), vocab_size=draw(st.integers(3, 70)),
        tie_embeddings=draw(st.booleans()), num_experts=draw(st.sampled_from([2, 3, 4, 8])),
        moe_intermediate_size=draw(st.sampled_from([4, 6, 8])), moe_layers=tuple(range(first_dense, layers)),
        num_shared_experts=draw(st.sampled_from([0, 1, 2])), router_bias=draw(st.booleans()),
        num_mtp_layers=draw(st.sampled_from([0, 1])), dtype="bfloat16")
    if arch == "deepseek_v3":
        nope, rope = draw(st.sampled_from([2, 4])), 2
        cfg = ModelConfig(arch=arch, num_kv_heads=heads, head_dim=nope + rope, q_lora_rank=draw(st.sampled_from([0, 4, 6])),
                          kv_lora_rank=draw(st.sampled_from([4, 8])), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                          v_head_dim=draw(st.sampled_from([2, 4])), **common)
    else:
        kv = draw(st.sampled_from([1, 2]))
        cfg = ModelConfig(arch=arch, num_kv_heads=kv, head_dim=draw(st.sampled_from([2, 4])), qkv_bias=True,
                          qk_norm=draw(st.booleans()), **{**common, "num_heads": kv * draw(st.sampled_from([1, 2, 3]))})
    return build_spec(f"random-{arch}", cfg)


@st.composite
def model_specs(draw) -> ModelSpec:
    arch = draw(st.sampled_from(["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe"]))
    if arch in ("deepseek_v3", "glm4_moe"):
        return draw(family_specs(arch))
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([2, 4]))
    layers = draw(st.integers(1, 6))
    experts, moe_inter, moe_layers = 0, 0, ()
    if arch == "qwen3_moe":
        experts = draw(st.sampled_from([2, 3, 4, 8]))
        moe_inter = draw(st.sampled_from([4, 6, 8, 12]))
        step = draw(st.sampled_from([1, 1, 2]))
        moe_layers = tuple(l for l in range(layers) if (l + 1) % step == 0)
    hidden = draw(st.sampled_from([4, 8, 12]))
    if arch == "qwen2":  # vLLM's Qwen2 derives head_dim from hidden/heads
        hidden = heads * head_dim
    cfg = ModelConfig(
        arch=arch, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv, head_dim=head_dim, intermediate_size=draw(st.sampled_from([8, 12, 24])),
        vocab_size=draw(st.integers(3, 70)), tie_embeddings=draw(st.booleans()),
        qkv_bias=arch == "qwen2", qk_norm=arch.startswith("qwen3"), num_experts=experts,
        moe_intermediate_size=moe_inter, moe_layers=moe_layers, dtype="bfloat16")
    return build_spec(f"random-{arch}", cfg)


@st.composite
def megatron_layouts(draw, spec: ModelSpec) -> MegatronLayout:
    c = spec.config
    qkv_rows = 0 if c.is_mla else (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    tp_choices = [d for d in divisors(c.num_heads) if c.intermediate_size % d == 0 and qkv_rows % d == 0
                  and c.shared_intermediate_size % d == 0
                  and (c.is_mla or c.num_kv_heads % d == 0 or d % c.num_kv_heads == 0)]
    tp = draw(st.sampled_from(tp_choices))
    cp = draw(st.sampled_from([1, 1, 2]))
    ep, etp = 1, None
    if c.is_moe:
        ep = draw(st.sampled_from(divisors(c.num_experts, 4)))
        etp = draw(st.sampled_from(divisors(c.moe_intermediate_size, 4)))
    pp = draw(st.sampled_from([p for p in (1, 2, 3) if p <= c.num_layers]))
    vpp, first, last = 1, None, None
    if pp > 1:
        even = [v for v in (1, 2) if c.num_layers % (pp * v) == 0]
        if even and draw(st.booleans()):
            vpp = draw(st.sampled_from(even))
        else:  # an uneven split: give the first stage between 0 and the rest's share
            rest = pp - 1
            first = draw(st.integers(0, c.num_layers))
            if (c.num_layers - first) % rest:
                first = c.num_layers % rest
    base = MegatronLayout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, cp=cp, first=first, last=last)
    dp = base.dp_ * draw(st.sampled_from([1, 1, 2]))
    vocabdiv = draw(st.sampled_from([128, 128, 1, 4]))  # Megatron's padding, or a bridge's (unpadded)
    # MLA built with the local spec: down-projections split over tp (where their rows divide)
    splits = c.is_mla and (c.q_lora_rank or 0) % tp == 0 and (c.kv_lora_rank + c.qk_rope_head_dim) % tp == 0
    local = draw(st.sampled_from([0, 1])) if splits else 0
    return MegatronLayout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, cp=cp, dp=dp, first=first, last=last,
                          vocabdiv=vocabdiv, local=local)


@st.composite
def vllm_layouts(draw, spec: ModelSpec) -> VllmLayout:
    c = spec.config
    tp_choices = [t for t in range(1, 9) if c.num_heads % t == 0 and c.intermediate_size % t == 0
                  and (c.num_kv_heads % t == 0 or t % c.num_kv_heads == 0) and c.shared_intermediate_size % t == 0
                  and (-(-c.vocab_size // 64) * 64) % t == 0
                  and (not c.is_moe or c.moe_intermediate_size % t == 0 or c.num_experts >= t)]
    tp = draw(st.sampled_from(tp_choices))
    dp = draw(st.sampled_from([1, 1, 2, 3]))
    if c.is_moe:
        use_ep = draw(st.booleans()) and c.num_experts >= tp * dp
        if not use_ep and c.moe_intermediate_size % (tp * dp):
            dp = 1
            if c.moe_intermediate_size % tp:
                use_ep = c.num_experts >= tp
        return VllmLayout(tp=tp, dp=dp, ep=tp * dp if use_ep else None)
    return VllmLayout(tp=tp, dp=dp)


@st.composite
def layouts(draw, spec: ModelSpec):
    kinds = ["megatron", "megatron", "vllm", "vllm", "fsdp", "hf"]
    kind = draw(st.sampled_from(kinds))
    if kind == "megatron":
        layout = draw(megatron_layouts(spec))
    elif kind == "vllm":
        layout = draw(vllm_layouts(spec))
    elif kind == "fsdp":
        moe = spec.config.num_experts > 0  # HSDP, FSDP x TP (dense models) and fused experts (MoE) too
        layout = FsdpLayout(dp=draw(st.integers(1, 5)), rep=draw(st.sampled_from([1, 1, 2, 3])),
                            tp=1 if moe else draw(st.sampled_from([1, 1, 2, 3])),
                            fused=draw(st.sampled_from([0, 1])) if moe else 0)
    else:
        layout = HFLayout()
    return layout.resolve(spec)
