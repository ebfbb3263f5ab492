"""Real megatron-core GPTModels on CPU for the attach tests, over *real* gloo process groups
(unlike tests/harness/megatron/, whose fake groups cannot move data).

CPU shims (see tests/harness/megatron/FACTS.md): Megatron allocates some buffers on
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
        pp_rank = ps.get_pipeline_model_parallel_rank()
        model = GPTModel(config, block, vocab_size=pad_to(c.vocab_size, VOCAB_DIVISIBLE_BY * tp),
                         max_sequence_length=64, pre_process=pp_rank == 0 and v == 0,
                         post_process=pp_rank == pp - 1 and v == (vpp or 1) - 1,
                         share_embeddings_and_output_weights=c.tie_embeddings, position_embedding_type="rope",
                         vp_stage=stage)
        chunks.append(Float16Module(config, model))  # as Megatron-LM trains in bf16: norms cast too
    return chunks


# ------------------------------------------------------------------------------------------------
# Values placed by Megatron's own sharded_state_dict, and the HF tensors they make


def _values(key: str, global_shape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...],
            version: int) -> torch.Tensor:
    """Pseudo-random bf16 values of the box ``offset/shape`` of global checkpoint tensor ``key``:
    a function of (key, global element index, version) only, so replicas agree."""
    flat = torch.zeros(shape, dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(global_shape))):
        idx = torch.arange(offset[d], offset[d] + shape[d], dtype=torch.int64) * stride
        flat = flat + idx.view([-1 if i == d else 1 for i in range(len(shape))])
        stride *= global_shape[d]
    salt = sum(ord(ch) * 131 ** i for i, ch in enumerate(key)) % (1 << 31)
    x = (flat * 2654435761 + salt * 97 + version * 40503 + 12345) % (1 << 31)
    x = (x ^ (x >> 15)) * 2246822519 % (1 << 31)
    return ((x >> 7).to(torch.float32) / float(1 << 24) - 0.5).to(torch.bfloat16)


def sharded_tensors(chunks: list[torch.nn.Module]) -> list[Any]:
    """Every ShardedTensor of the chunks' ``sharded_state_dict`` (factories such as SwiGLU's built)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for chunk in chunks:
        for obj in chunk.sharded_state_dict().values():
            if isinstance(obj, ShardedTensorFactory):
                built = obj.build()
                out.extend(built if isinstance(built, list) else [built])
            elif isinstance(obj, ShardedTensor):
                out.append(obj)
    return out


def fill_by_placement(chunks: list[torch.nn.Module], version: int) -> dict[str, tuple[int, ...]]:
    """Write every parameter in place with `_values` at the global position Megatron's own
    ``sharded_state_dict`` gives it; returns checkpoint key -> global shape."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    shapes: dict[str, tuple[int, ...]] = {}
    with torch.no_grad():
        for p in params:
            p.fill_(float("nan"))
        for sh in sharded_tensors(chunks):
            assert sh.flattened_range is None
            lead = len(sh.global_shape) - len(sh.local_shape)  # prepended axes (layer, expert)
            box = (1,) * lead + tuple(sh.local_shape)
            sh.data.copy_(_values(sh.key, tuple(sh.global_shape), tuple(sh.global_offset), box,
                                  version).view(sh.data.shape))
            shapes[sh.key] = tuple(sh.global_shape)
        unfilled = [i for i, p in enumerate(params) if torch.isnan(p.float()).any()]
        assert not unfilled, f"{len(unfilled)} parameters are not (wholly) in sharded_state_dict"
    return shapes


def megatron_to_hf(shapes: dict[str, tuple[int, ...]], spec: ModelSpec, version: int) -> dict[str, torch.Tensor]:
    """The HF tensors of the global checkpoint tensors, converted by hand after
    tests/harness/megatron/FACTS.md (fused QKV per query group, fc1 = [gate; up], experts on a global axis)."""
    g = {k: _values(k, s, (0,) * len(s), s, version) for k, s in shapes.items()}
    c = spec.config
    V, G, hd = c.vocab_size, c.num_kv_heads, c.head_dim
    qg = c.num_heads // G
    out = {"model.embed_tokens.weight": g["embedding.word_embeddings.weight"][:V],
           "model.norm.weight": g["decoder.final_layernorm.weight"]}
    if not c.tie_embeddings:
        out["lm_head.weight"] = g["output_layer.weight"][:V]

    def get(layer: int, name: str) -> torch.Tensor:
        key = f"decoder.layers.{layer}.{name}"
        return g[key] if key in g else g[f"decoder.layers.{name}"][layer]  # per-layer or stacked keys

    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = get(layer, "self_attention.linear_qkv.layer_norm_weight")
        for kind in ("weight", "bias") if c.qkv_bias else ("weight",):
            w = get(layer, f"self_attention.linear_qkv.{kind}")
            w = w.reshape(G, (qg + 2) * hd, *w.shape[1:])
            for proj, lo, n in (("q", 0, qg * hd), ("k", qg * hd, hd), ("v", (qg + 1) * hd, hd)):
                out[p + f"self_attn.{proj}_proj.{kind}"] = w[:, lo:lo + n].reshape(G * n, *w.shape[2:])
        out[p + "self_attn.o_proj.weight"] = get(layer, "self_attention.linear_proj.weight")
        if c.qk_norm:
            out[p + "self_attn.q_norm.weight"] = get(layer, "self_attention.q_layernorm.weight")
            out[p + "self_attn.k_norm.weight"] = get(layer, "self_attention.k_layernorm.weight")
        out[p + "post_attention_layernorm.weight"] = get(layer, "mlp.linear_fc1.layer_norm_weight")
        if layer in c.moe_layers:
            I = c.moe_intermediate_size
            out[p + "mlp.gate.weight"] = get(layer, "mlp.router.weight")
            fc1, fc2 = get(layer, "mlp.experts.experts.linear_fc1.weight"), get(layer, "mlp.experts.experts.linear_fc2.weight")
            for e in range(c.num_experts):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = fc1[e, :I]
                out[p + f"mlp.experts.{e}.up_proj.weight"] = fc1[e, I:]
                out[p + f"mlp.experts.{e}.down_proj.weight"] = fc2[e]
        else:
            F = c.intermediate_size
            fc1 = get(layer, "mlp.linear_fc1.weight")
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = fc1[:F], fc1[F:]
            out[p + "mlp.down_proj.weight"] = get(layer, "mlp.linear_fc2.weight")
    return {k: v.contiguous() for k, v in out.items()}
