"""Real megatron-core GPTModels on CPU for the attach tests, over *real* gloo process groups
(unlike tests/megatron_harness.py, whose fake groups cannot move data).

CPU shims (see tests/MEGATRON_FACTS.md): Megatron allocates some buffers on
``torch.cuda.current_device()`` and calls ``Tensor.cuda()`` in the tied-embedding setup when
pp > 1; both are redirected to the CPU in the spawned test processes only.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from refit.layouts.base import pad_to
from refit.layouts.megatron import VOCAB_DIVISIBLE_BY
from refit.spec import ModelSpec


def install_cpu_shims() -> None:
    warnings.filterwarnings("ignore")
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]


def init_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1, etp: int | None = None) -> None:
    """initialize_model_parallel on the (already initialized, gloo) default process group."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp, create_gloo_process_groups=False)
    try:
        model_parallel_cuda_manual_seed(1234)
    except Exception:  # needs CUDA's RNG tracker on some versions; CPU init does not use it
        pass


def build_gpt(spec: ModelSpec, *, te_names: bool = False, vpp: int | None = None, seed: int = 0,
              **overrides: Any) -> list[torch.nn.Module]:
    """This rank's model chunks of a GPTModel shaped like ``spec`` (local spec; bf16 parameters with
    random, never-zero values), after `init_parallel`."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    c = spec.config
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    kw: dict[str, Any] = dict(
        num_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_heads,
        num_query_groups=c.num_kv_heads, kv_channels=c.head_dim, ffn_hidden_size=c.intermediate_size,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        pipeline_dtype=torch.bfloat16, params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=True,
        qk_layernorm=c.qk_norm, add_qkv_bias=c.qkv_bias, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, bias_activation_fusion=False, bias_dropout_fusion=False, add_bias_linear=False,
        init_method_std=0.02)
    if c.is_moe:
        kw.update(num_moe_experts=c.num_experts, moe_ffn_hidden_size=c.moe_intermediate_size, moe_router_topk=2,
                  moe_layer_freq=[1 if layer in c.moe_layers else 0 for layer in range(c.num_layers)],
                  moe_grouped_gemm=False)
    kw.update(overrides)
    config = TransformerConfig(**kw)
    torch.manual_seed(seed + 1000 * torch.distributed.get_rank())
    chunks = []
    for v in range(vpp or 1):
        stage = v if vpp else None
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                           vp_stage=stage, pp_rank=ps.get_pipeline_model_parallel_rank())
        model = GPTModel(config, block, vocab_size=pad_to(c.vocab_size, VOCAB_DIVISIBLE_BY * tp),
                         max_sequence_length=64, pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                         share_embeddings_and_output_weights=c.tie_embeddings, position_embedding_type="rope",
                         vp_stage=stage)
        chunks.append(Float16Module(config, model))  # as Megatron-LM trains in bf16: norms cast too
    return chunks
