"""Documented (not executed) TE-spec names:

* ``te_spec_param_name``              -> NOT executed: documented local->TE name mapping
"""

from __future__ import annotations


def te_spec_param_name(local_name: str, is_moe_layer: bool, moe_grouped_gemm: bool = True) -> str:
    """Map a local-spec ``named_parameters`` name to the name the TE spec
    (``get_gpt_layer_with_transformer_engine_spec`` / ``get_gpt_decoder_block_spec(...,
    use_transformer_engine=True)``) gives the same tensor.  THIS IS A DOCUMENTED MAPPING, NOT
    EXECUTED MEGATRON CODE (Transformer Engine cannot be imported here); sources:
      * TE spec: ``input_layernorm`` is IdentityOp and ``linear_qkv`` is
        TELayerNormColumnParallelLinear (TE LayerNormLinear: params ``layer_norm_weight``
        [+ ``layer_norm_bias`` for LayerNorm], ``weight`` [, ``bias``]);
      * dense layer: ``pre_mlp_layernorm`` is IdentityOp, ``mlp.linear_fc1`` is
        TELayerNormColumnParallelLinear -> ``mlp.linear_fc1.layer_norm_weight``;
      * MoE layer: ``pre_mlp_layernorm`` is TENorm (param ``weight``) -> name unchanged;
        experts: moe_grouped_gemm=True -> TEGroupedMLP with TE GroupedLinear (params
        ``weight{i}``/``bias{i}``) -> ``mlp.experts.linear_fc1.weight{i}``; moe_grouped_gemm=False
        -> SequentialMLP of TEColumn/RowParallelLinear -> names unchanged
        (``mlp.experts.local_experts.{i}.linear_fc1.weight``);
      * q/k layernorm TENorm (weight), final_layernorm TENorm (weight), router, embedding,
        output_layer: unchanged.
    """
    import re

    n = local_name
    n = re.sub(r"\.input_layernorm\.(weight|bias)$", r".self_attention.linear_qkv.layer_norm_\1", n)
    if not is_moe_layer:
        n = re.sub(r"\.pre_mlp_layernorm\.(weight|bias)$", r".mlp.linear_fc1.layer_norm_\1", n)
    elif moe_grouped_gemm:
        n = re.sub(
            r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$",
            r".mlp.experts.\2.\3\1",
            n,
        )
    return n
