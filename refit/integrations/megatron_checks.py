"""What `refit.integrations.megatron.attach` reads from a live Megatron-Core job, and checks against
the spec, before it registers anything.

`layout_from_parallel_state` builds refit's `MegatronLayout` from ``megatron.core.parallel_state``
and the model (the uneven pipeline split, the vocabulary's padding, whether MLA's down-projections
are split); the ``check_*`` functions refuse, with the numbers, a config, a rank's coordinates, a
padded vocabulary or a chunk's layers (MTP layers included) that differ from what the spec and
layout say.  Apart from `refit.integrations.megatron` because none of it touches a parameter's values:
that module serves the parameters these checks have vetted.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from refit.drafters import mtp_layers
from refit.errors import InvalidInput
from refit.layouts import MegatronLayout
from refit.layouts.base import pad_to
from refit.layouts.megatron import VOCAB_DIVISIBLE_BY
from refit.spec import ModelSpec


def layout_from_parallel_state(spec: ModelSpec, chunks: Sequence[torch.nn.Module]) -> MegatronLayout:
    """refit's megatron layout of this job, degrees read from ``megatron.core.parallel_state``."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise InvalidInput("megatron.core.parallel_state is not initialized: call initialize_model_parallel first")
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    if len(chunks) != vpp:
        raise InvalidInput(f"got {len(chunks)} model chunks, parallel_state says virtual pipeline size {vpp}")
    cfg = chunks[0].config
    if getattr(cfg, "pipeline_model_parallel_layout", None) is not None:
        raise InvalidInput("pipeline_model_parallel_layout is not supported; use num_layers_in_first/last_pipeline_stage")
    moe = spec.config.is_moe
    pp = ps.get_pipeline_model_parallel_world_size()
    first = getattr(cfg, "num_layers_in_first_pipeline_stage", None)
    last = getattr(cfg, "num_layers_in_last_pipeline_stage", None)
    emb = bool(getattr(cfg, "account_for_embedding_in_pipeline_split", False))
    loss = bool(getattr(cfg, "account_for_loss_in_pipeline_split", False))
    if (emb or loss) and pp > 1:
        # Megatron's get_num_layers_to_build: the embedding and/or the loss count as a layer each,
        # (L + emb + loss) / pp layers a stage, and the first / last stage builds one layer fewer
        if vpp > 1:
            raise InvalidInput("account_for_embedding/loss_in_pipeline_split with a virtual pipeline is not supported; "
                             "use num_layers_in_first/last_pipeline_stage")
        per_stage = (cfg.num_layers + emb + loss) // pp
        first, last = (per_stage - 1 if emb else None), (per_stage - 1 if loss else None)
    tp = ps.get_tensor_model_parallel_world_size()
    layout = MegatronLayout(
        tp=tp, pp=pp, vpp=vpp,
        ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size() if moe else None,
        dp=ps.get_data_parallel_world_size(), cp=ps.get_context_parallel_world_size(), first=first, last=last,
        vocabdiv=vocab_divisor(spec.config.vocab_size, getattr(chunks[0], "vocab_size", None), tp),
        local=int(spec.config.is_mla and tp > 1 and split_down_projections(chunks)))
    return layout.resolve(spec)


def split_down_projections(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether the model's MLA down-projections are split over tp: the local spec builds them as
    ColumnParallelLinear (``local1`` in refit's layout), the Transformer Engine spec as TELinear
    ``duplicated``, whole on every rank.  Read from the live modules' types."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    for chunk in chunks:
        for name, module in chunk.named_modules():
            if name.endswith(("linear_q_down_proj", "linear_kv_down_proj")):
                return isinstance(module, ColumnParallelLinear)
    return False


def vocab_divisor(vocab: int, padded: int | None, tp: int) -> int:
    """The ``vocabdiv`` of a model built with ``padded`` rows of vocabulary: Megatron's default
    (a multiple of 128 * tp) when it fits, else the smallest divisor that gives it (1 for a
    bridge's unpadded embedding).  Padding no divisor explains keeps the default, and
    `check_vocab` refuses it with the numbers."""
    if padded is None or padded == pad_to(vocab, VOCAB_DIVISIBLE_BY * tp):
        return VOCAB_DIVISIBLE_BY
    if padded % tp == 0:
        for d in range(1, padded // tp + 1):
            if pad_to(vocab, d * tp) == padded:
                return d
    return VOCAB_DIVISIBLE_BY


def check_coords(layout: MegatronLayout, rank: int) -> None:
    """refit numbers ranks tp-cp-ep-dp-pp (Megatron's default order): refuse any other."""
    from megatron.core import parallel_state as ps

    got = dict(tp=ps.get_tensor_model_parallel_rank(), cp=ps.get_context_parallel_rank(),
               dp=ps.get_data_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
               etp=ps.get_expert_tensor_parallel_rank(), ep=ps.get_expert_model_parallel_rank(),
               edp=ps.get_expert_data_parallel_rank())
    want = layout.coords(rank)
    if layout.etp is None:  # a dense model has no experts: Megatron's expert grid (etp = tp by default) is moot
        got = {k: v for k, v in got.items() if k in ("tp", "cp", "dp", "pp")}
        want = {k: v for k, v in want.items() if k in got}
    if got != want:
        raise InvalidInput(f"global rank {rank} has parallel_state coordinates {got}, refit's {layout.describe()} "
                         f"expects {want}: initialize_model_parallel with the default order tp-cp-ep-dp-pp")


def check_config(chunks: Sequence[torch.nn.Module], spec: ModelSpec) -> None:
    """The megatron config against the spec, field by field: every field that differs, with both values."""
    cfg, c = chunks[0].config, spec.config
    checks = [("num_layers", cfg.num_layers, c.num_layers), ("hidden_size", cfg.hidden_size, c.hidden_size),
              ("num_attention_heads", cfg.num_attention_heads, c.num_heads),
              ("multi_latent_attention", bool(getattr(cfg, "multi_latent_attention", False)), c.is_mla),
              ("gated_linear_unit", bool(cfg.gated_linear_unit), True),
              ("normalization", cfg.normalization, "RMSNorm"),
              ("share_embeddings_and_output_weights", bool(chunks[0].share_embeddings_and_output_weights),
               c.tie_embeddings),
              ("num_moe_experts", cfg.num_moe_experts or 0, c.num_experts if c.is_moe else 0)]
    if c.is_mla:  # MLATransformerConfig; qk_layernorm builds the q_a / kv_a layernorms
        checks += [("q_lora_rank", getattr(cfg, "q_lora_rank", None) or 0, c.q_lora_rank),
                   ("kv_lora_rank", getattr(cfg, "kv_lora_rank", None), c.kv_lora_rank),
                   ("qk_head_dim", getattr(cfg, "qk_head_dim", None), c.qk_nope_head_dim),
                   ("qk_pos_emb_head_dim", getattr(cfg, "qk_pos_emb_head_dim", None), c.qk_rope_head_dim),
                   ("v_head_dim", getattr(cfg, "v_head_dim", None), c.v_head_dim),
                   ("qk_layernorm (MLA's q_a/kv_a layernorms)", bool(cfg.qk_layernorm), True)]
    else:
        checks += [("num_query_groups", cfg.num_query_groups or cfg.num_attention_heads, c.num_kv_heads),
                   ("kv_channels", cfg.kv_channels, c.head_dim), ("qk_layernorm", bool(cfg.qk_layernorm), c.qk_norm),
                   ("add_qkv_bias", bool(cfg.add_qkv_bias), c.qkv_bias)]
    if c.dense_layers:
        checks.append(("ffn_hidden_size", cfg.ffn_hidden_size, c.intermediate_size))
    if c.is_moe:
        checks += [("moe_ffn_hidden_size", cfg.moe_ffn_hidden_size, c.moe_intermediate_size),
                   ("MoE layers (moe_layer_freq)", _moe_layers(cfg), list(c.moe_layers)),
                   ("moe_shared_expert_intermediate_size",
                    getattr(cfg, "moe_shared_expert_intermediate_size", None) or 0, c.shared_intermediate_size),
                   ("moe_router_enable_expert_bias", bool(getattr(cfg, "moe_router_enable_expert_bias", False)),
                    c.router_bias)]
    wrong = [f"{what} is {got}, {spec.name} has {want}" for what, got, want in checks if got != want]
    if wrong:
        raise InvalidInput(f"megatron config {'; '.join(wrong)}")


def _moe_layers(cfg: Any) -> list[int] | str:
    """The 0-based layers ``moe_layer_freq`` makes MoE (get_gpt_decoder_layer_specs' rule)."""
    freq = cfg.moe_layer_freq
    if isinstance(freq, int):
        return [i for i in range(cfg.num_layers) if i % freq == 0]
    if isinstance(freq, (list, tuple)):
        return [i for i, f in enumerate(freq) if f == 1]
    return repr(freq)


def check_vocab(chunks: Sequence[torch.nn.Module], spec: ModelSpec, layout: MegatronLayout) -> None:
    """The model's (padded) vocabulary against the rows refit's layout gives the embedding."""
    want = pad_to(spec.config.vocab_size, layout.vocabdiv * layout.tp)
    got = getattr(chunks[0], "vocab_size", want)
    if got != want:
        raise InvalidInput(f"megatron model vocab_size (padded) is {got}, {spec.name}'s vocab {spec.config.vocab_size} "
                         f"padded to a multiple of {layout.vocabdiv}*tp{layout.tp} is {want} "
                         f"(make_vocab_size_divisible_by {layout.vocabdiv})")


def check_layers(layout: MegatronLayout, spec: ModelSpec, chunks: Sequence[torch.nn.Module], rank: int) -> None:
    """Each chunk built the layers refit's pipeline split gives it, MoE exactly where the spec has it."""
    pp = layout.coords(rank)["pp"]
    stages = layout.stage_layers(spec.config.num_layers)
    moe = set(spec.config.moe_layers)
    for c, chunk in enumerate(chunks):
        built = [int(layer.layer_number) - 1 for layer in chunk.decoder.layers]
        if built != stages[(pp, c)]:
            raise InvalidInput(f"pipeline rank {pp} chunk {c} built layers {built}, refit's {layout.describe()} "
                             f"places layers {stages[(pp, c)]} there")
        for layer_id, layer in zip(built, chunk.decoder.layers):
            if hasattr(layer.mlp, "router") != (layer_id in moe):
                raise InvalidInput(f"layer {layer_id} is {'MoE' if hasattr(layer.mlp, 'router') else 'dense'} in the "
                                 f"model, {'MoE' if layer_id in moe else 'dense'} in {spec.name}")


def check_mtp_layers(chunk: torch.nn.Module, drafter: ModelSpec) -> None:
    """The last stage built the MTP layers, each MoE exactly where vLLM's drafter has it."""
    c = drafter.config
    built = list(getattr(getattr(chunk, "mtp", None), "layers", None) or [])
    if len(built) != c.num_mtp_layers:
        raise InvalidInput(f"the last pipeline stage built {len(built)} MTP layer(s), {drafter.name} has "
                           f"{c.num_mtp_layers} (GPTModel's mtp_block_spec)")
    for i, (hf_layer, layer) in enumerate(zip(mtp_layers(c), built)):
        moe = hasattr(layer.transformer_layer.mlp, "router")
        if moe != (hf_layer in c.moe_layers):
            raise InvalidInput(f"MTP layer {i} is {'MoE' if moe else 'dense'} in the model, "
                               f"{'MoE' if hf_layer in c.moe_layers else 'dense'} in {drafter.name} (its HF layer "
                               f"{hf_layer}, as vLLM's drafter builds it)")
