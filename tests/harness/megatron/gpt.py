"""GPTModel parameter names:

* ``megatron_gpt_param_names``        -> a real tiny ``GPTModel`` (local, non-TE spec) for every
  (global rank, vp chunk), its ``named_parameters``/persistent buffers and its
  ``sharded_state_dict`` (dist-checkpoint keys, global shapes/offsets) (subprocess)
"""

from __future__ import annotations

from typing import Optional

from tests.harness.megatron.cpu import fake_world, install_cpu_shims, ps_coords, teardown_world
from tests.harness.megatron.worker import register, run_subprocess


def megatron_gpt_param_names(
    *,
    num_layers: int = 2,
    hidden_size: int = 16,
    num_attention_heads: int = 4,
    num_query_groups: int = 2,
    kv_channels: Optional[int] = None,
    ffn_hidden_size: int = 32,
    moe_ffn_hidden_size: int = 8,
    num_experts: Optional[int] = 4,
    moe_layer_freq: int | list = 1,
    vocab_size: int = 128,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    vpp: Optional[int] = None,
    first: Optional[int] = None,
    last: Optional[int] = None,
    share_embeddings_and_output_weights: bool = False,
    qk_layernorm: bool = True,
    moe_grouped_gemm: bool = False,
    moe_router_enable_expert_bias: bool = True,
    moe_shared_expert_intermediate_size: Optional[int] = None,
    normalization: str = "RMSNorm",
    add_bias_linear: bool = False,
    add_qkv_bias: bool = False,
    world_size: Optional[int] = None,
    ranks: Optional[list[int]] = None,
    with_sharded: bool = True,
    sharded_metadata: Optional[dict] = None,
) -> dict[tuple[int, int], dict]:
    """Build a real tiny ``GPTModel`` with the local (non-TE) spec
    (``get_gpt_decoder_block_spec(config, use_transformer_engine=False, ...)``) for every
    (global rank, vp chunk) of the world and report what it contains.  world_size defaults to
    the smallest world in which both grids fit: pp * lcm(tp, ep*etp) (etp None -> tp).

    Returns {(rank, vp_chunk): entry}, entry = {
      'coords': Megatron's ranks (tp/cp/dp/pp/etp/ep/edp) of that rank,
      'pre_process', 'post_process': bool,
      'params':  [(name, shape)] from named_parameters(),
      'buffers': [(name, shape)] persistent buffers that appear in state_dict() (e.g.
                 mlp.router.expert_bias),
      'layer_numbers': [layer.layer_number - 1 for layer in decoder.layers] (global 0-based),
      'local_expert_indices': {module_prefix: MoELayer.local_expert_indices},
      'sharded': [(local_name, ckpt_key, local_shape, global_shape, global_offset)] from
                 model.sharded_state_dict() (factories such as the SwiGLU fc1 are expanded;
                 _extra_state ShardedObjects are skipped), only if with_sharded; the metadata
                 passed is ``sharded_metadata`` (e.g. {'non_homogeneous_layers': True}; default
                 None -> layers are stacked under 'decoder.layers.<name>' with a leading layer axis
                 unless moe_layer_freq is a list / >1, then per-layer 'decoder.layers.<global i>.'),
    }
    ``moe_grouped_gemm=True`` builds the legacy ``GroupedMLP`` (the grouped_gemm shim in ``cpu.py``).
    """
    res = run_subprocess(
        "gpt_param_names",
        cfg=dict(
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            num_query_groups=num_query_groups,
            kv_channels=kv_channels,
            ffn_hidden_size=ffn_hidden_size,
            moe_ffn_hidden_size=moe_ffn_hidden_size,
            num_experts=num_experts,
            moe_layer_freq=moe_layer_freq,
            vocab_size=vocab_size,
            tp=tp,
            pp=pp,
            ep=ep,
            etp=etp,
            vpp=vpp,
            first=first,
            last=last,
            share=share_embeddings_and_output_weights,
            qk_layernorm=qk_layernorm,
            moe_grouped_gemm=moe_grouped_gemm,
            expert_bias=moe_router_enable_expert_bias,
            shared_expert=moe_shared_expert_intermediate_size,
            normalization=normalization,
            add_bias_linear=add_bias_linear,
            add_qkv_bias=add_qkv_bias,
        ),
        world_size=world_size,
        ranks=ranks,
        with_sharded=with_sharded,
        sharded_metadata=sharded_metadata,
    )
    out = {}
    for e in res:
        key = (e.pop("rank"), e.pop("vp_chunk"))
        e["params"] = [(n, tuple(s)) for n, s in e["params"]]
        e["buffers"] = [(n, tuple(s)) for n, s in e["buffers"]]
        e["sharded"] = [
            (a, b, tuple(c), tuple(d), tuple(f)) for a, b, c, d, f in e.get("sharded", [])
        ]
        out[key] = e
    return out


@register("gpt_param_names")
def _impl_gpt_param_names(cfg, world_size, ranks, with_sharded, sharded_metadata):
    install_cpu_shims()
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    if cfg["moe_grouped_gemm"]:
        from megatron.core.transformer.moe import grouped_gemm_util

        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None

    tp, pp, ep = cfg["tp"], cfg["pp"], cfg["ep"]
    etp = cfg["etp"] if cfg["etp"] is not None else tp
    import math

    world = world_size if world_size is not None else pp * math.lcm(tp, ep * etp)
    vpp = cfg["vpp"]
    chunks = vpp if vpp is not None else 1
    moe = cfg["num_experts"] is not None
    freq = cfg["moe_layer_freq"]

    out = []
    for r in ranks if ranks is not None else range(world):
        fake_world(r, world)
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp,
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=cfg["etp"],
                create_gloo_process_groups=False,
            )
            coords = ps_coords()
            pp_rank = coords["pp"]
            tc_kwargs = dict(
                num_layers=cfg["num_layers"],
                hidden_size=cfg["hidden_size"],
                num_attention_heads=cfg["num_attention_heads"],
                num_query_groups=cfg["num_query_groups"],
                kv_channels=cfg["kv_channels"],
                ffn_hidden_size=cfg["ffn_hidden_size"],
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp,
                num_layers_in_first_pipeline_stage=cfg["first"],
                num_layers_in_last_pipeline_stage=cfg["last"],
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=cfg["etp"],
                pipeline_dtype=torch.float32,
                params_dtype=torch.float32,
                use_cpu_initialization=True,
                qk_layernorm=cfg["qk_layernorm"],
                normalization=cfg["normalization"],
                gated_linear_unit=True,
                activation_func=F.silu,
                bias_activation_fusion=False,
                bias_dropout_fusion=False,
                add_bias_linear=cfg["add_bias_linear"],
                add_qkv_bias=cfg["add_qkv_bias"],
            )
            if moe:
                tc_kwargs.update(
                    num_moe_experts=cfg["num_experts"],
                    moe_ffn_hidden_size=cfg["moe_ffn_hidden_size"],
                    moe_router_topk=min(2, cfg["num_experts"]),
                    moe_router_enable_expert_bias=cfg["expert_bias"],
                    moe_router_score_function="sigmoid" if cfg["expert_bias"] else "softmax",
                    moe_layer_freq=freq,
                    moe_grouped_gemm=cfg["moe_grouped_gemm"],
                    moe_shared_expert_intermediate_size=cfg["shared_expert"],
                )
            config = TransformerConfig(**tc_kwargs)
            for v in range(chunks):
                vp_stage = v if vpp is not None else None
                pre = pp_rank == 0 and v == 0
                post = pp_rank == pp - 1 and v == chunks - 1
                spec = get_gpt_decoder_block_spec(
                    config,
                    use_transformer_engine=False,
                    normalization=cfg["normalization"],
                    vp_stage=vp_stage,
                    pp_rank=pp_rank,
                )
                model = GPTModel(
                    config,
                    spec,
                    vocab_size=cfg["vocab_size"],
                    max_sequence_length=32,
                    pre_process=pre,
                    post_process=post,
                    share_embeddings_and_output_weights=cfg["share"],
                    position_embedding_type="rope",
                    vp_stage=vp_stage,
                )
                params = [[n, list(p.shape)] for n, p in model.named_parameters()]
                sd = model.state_dict()
                pnames = {n for n, _ in params}
                buffers = [
                    [n, list(b.shape)]
                    for n, b in model.named_buffers()
                    if n in sd and n not in pnames
                ]
                layer_numbers = [int(l.layer_number) - 1 for l in model.decoder.layers]
                lei = {
                    n: list(m.local_expert_indices)
                    for n, m in model.named_modules()
                    if isinstance(m, BaseMoELayer)
                }
                entry = dict(
                    rank=r,
                    vp_chunk=v,
                    coords=coords,
                    pre_process=pre,
                    post_process=post,
                    params=params,
                    buffers=buffers,
                    layer_numbers=layer_numbers,
                    local_expert_indices=lei,
                )
                if with_sharded:
                    sharded = []
                    ssd = model.sharded_state_dict(
                        metadata=dict(sharded_metadata) if sharded_metadata is not None else None
                    )
                    for k, obj in ssd.items():
                        if isinstance(obj, ShardedTensorFactory):
                            built = obj.build()
                            built = built if isinstance(built, list) else [built]
                        elif isinstance(obj, ShardedTensor):
                            built = [obj]
                        else:
                            continue
                        for sh in built:
                            sharded.append(
                                [
                                    k,
                                    sh.key,
                                    list(sh.local_shape),
                                    list(sh.global_shape),
                                    [int(o) for o in sh.global_offset],
                                ]
                            )
                    entry["sharded"] = sharded
                out.append(entry)
        finally:
            teardown_world()
    return out
