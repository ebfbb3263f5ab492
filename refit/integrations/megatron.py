"""Attach a megatron-core GPTModel (or its list of virtual-pipeline chunks) to the refit control plane.

    from refit.integrations import megatron as refit_megatron
    agent = refit_megatron.attach(model, "127.0.0.1:50051", group="trainer", spec="/path/to/hf_dir")

Called on every rank after ``parallel_state.initialize_model_parallel`` (and after wrapping the
model in Megatron's DDP, whose buffers the parameters then live in).  The layout is read from
``megatron.core.parallel_state`` (tp, pp, vpp, ep, etp, cp, dp) and the config's uneven pipeline
split (``num_layers_in_first/last_pipeline_stage`` or ``account_for_embedding/loss_in_pipeline_split``),
then checked against the model itself: this rank's coordinates, the layers each chunk
built, the config's dimensions against the spec's.

Models: Llama, Qwen2/3, Qwen3-MoE, DeepSeek-V3 / Kimi-K2 / Moonlight (MLA with or without q LoRA,
dense first layers, shared experts, the router's ``expert_bias``) and GLM-4.5 (GQA with qkv bias,
qk-norm as its config says, partial rotary, which changes no tensor, shared experts, the router's
``expert_bias``); names and config fields checked against megatron-core 0.16.1.

Names: refit's megatron layout uses the Transformer Engine spec's names.  The local (non-TE) spec
differs in these places, mapped here:

* ``input_layernorm.weight`` is TE's ``self_attention.linear_qkv.layer_norm_weight`` (GQA; MLA's
  TE spec keeps ``input_layernorm.weight``);
* on dense layers ``pre_mlp_layernorm.weight`` is TE's ``mlp.linear_fc1.layer_norm_weight``
  (MoE layers keep ``pre_mlp_layernorm.weight`` in both specs);
* MLA's ``self_attention.q_layernorm.weight`` / ``kv_layernorm.weight`` are TE's
  ``linear_q_up_proj.layer_norm_weight`` / ``linear_kv_up_proj.layer_norm_weight``;
* SequentialMLP experts ``mlp.experts.local_experts.{i}.linear_fc1.weight`` are TE grouped-GEMM's
  ``mlp.experts.linear_fc1.weight{i}`` (same for fc2), with either spec.

Shared experts (``mlp.shared_experts.linear_fc1/fc2``) and the router (``mlp.router.weight``) are
named alike in both.  The router's ``expert_bias`` is a buffer, not a parameter: served too, in
float32 (Megatron's ``Float16Module`` casts it to bf16 and the router casts it back before each
forward and checkpoint save, ``TopKRouter._maintain_float32_expert_bias``, which attach calls
likewise).  MLA's down-projections (``linear_q_down_proj``, ``linear_kv_down_proj``) are whole on
every tp rank as TE's ``TELinear(parallel_mode="duplicated")`` holds them, and split by rows over tp
as the local spec's ColumnParallelLinear holds them: attach reads which from the live modules
(`split_down_projections`; ``local1`` in the layout it registers).

Multi-token prediction layers (``mtp.*``, DeepSeek-V3 / GLM-4.5) are vLLM's MTP *drafter*, a model
of its own (`refit.drafters`): ``attach`` leaves them out (logged), and ``attach_mtp`` serves them as
a second trainer group, which a speculative engine's draft group is refitted from::

    agent = refit_megatron.attach(model, address, group="trainer", spec=hf_dir)
    draft = refit_megatron.attach_mtp(model, address, group="draft-trainer", spec=hf_dir)  # None off the last stage

Megatron builds them on the last pipeline stage only, so the drafter's group is that stage's ranks,
numbered from 0 in the same order, with the stage's grid as layout (pp 1).  The embedding copy
Megatron gives the MTP layers on a stage without the embedding is the policy's (vLLM's drafter
holds the target's embedding and LM head): served by neither.

Values are the live parameters (``detach()``: a view, never a copy), looked up by module path at
every refit (a parameter object replaced since attach is followed, `ParameterPaths`).  Under
Megatron's DDP with the distributed optimizer every parameter's data is a view into DDP's contiguous
param buffer, so they are served from that buffer (checked on CPU).  On GPU the views share the buffer's one
allocation, which torch's CUDA IPC exports and opens once per allocation, not per parameter (torch's
mechanism; not exercised on a GPU by refit's tests).

Refused, naming the parameter or setting: the legacy ``GroupedMLP`` (``experts.weight1``), linear
biases (``add_bias_linear``), a shared-expert gate, and any config field that contradicts the spec.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Container, Mapping, Sequence

import torch

from refit.control.agent import TrainerAgent
from refit.drafters import mtp_config, mtp_layers
from refit.errors import InvalidInput
from refit.integrations._common import ParameterPaths, Served, global_rank, refuse_unmapped, start_trainer
from refit.layouts import MegatronLayout
from refit.layouts.megatron import VOCAB_DIVISIBLE_BY
from refit.layouts.base import pad_to
from refit.hf_checkpoint import hf_config, load_spec
from refit.spec import ModelConfig, ModelSpec, build_spec

__all__ = ["attach", "attach_mtp", "layout_from_parallel_state"]

log = logging.getLogger(__name__)

# a decoder layer: of the decoder, or an MTP layer's
_LAYER = r"(?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\."
# local-spec name -> TE-spec name (refit's), tried when a name is not a local tensor as is
_LOCAL_TO_TE = (
    (re.compile(rf"^({_LAYER})input_layernorm\.weight$"), r"\1self_attention.linear_qkv.layer_norm_weight"),
    (re.compile(rf"^({_LAYER})pre_mlp_layernorm\.weight$"), r"\1mlp.linear_fc1.layer_norm_weight"),
    (re.compile(rf"^({_LAYER}self_attention\.)q_layernorm\.weight$"), r"\1linear_q_up_proj.layer_norm_weight"),
    (re.compile(rf"^({_LAYER}self_attention\.)kv_layernorm\.weight$"), r"\1linear_kv_up_proj.layer_norm_weight"),
    (re.compile(rf"^({_LAYER}mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$"), r"\1\3.weight\2"),
)


def attach(model: torch.nn.Module | Sequence[torch.nn.Module], address: str | None = None, *, group: str = "trainer",
           spec: str | ModelSpec, token: str | None = None, **agent_options: Any) -> TrainerAgent:
    """Register this rank of a megatron-core ``GPTModel`` (or list of model chunks, DDP-wrapped or
    not) as rank (global rank) of ``group``; ``spec``: an HF directory, a catalog name or a
    `ModelSpec`.  Call on every rank.  Returns the started agent.  Raises `refit.InvalidInput`,
    before registering, for a model, parallel state or parameter that does not match the spec.
    ``address`` and ``token`` default to ``$REFIT_ADDRESS`` (else 127.0.0.1:50051) and
    ``$REFIT_TOKEN``."""
    spec = spec if isinstance(spec, ModelSpec) else load_spec(spec)
    wrappers = _wrappers(model)
    if any(getattr(getattr(w, "ddp_config", None), "overlap_param_gather", False) for w in wrappers):
        # The distributed optimizer then all-gathers updated parameters during the *next* forward:
        # right after optimizer.step() the buffers hold other ranks' old shards.
        log.warning("overlap_param_gather is on: before each refit, finish the parameter all-gather "
                    "(model_chunk.start_param_sync(force_sync=True) on every chunk), or refits send stale shards")
    chunks = [_unwrap(m) for m in wrappers]
    _check_config(chunks, spec)
    layout = layout_from_parallel_state(spec, chunks)
    _check_vocab(chunks, spec, layout)
    rank = global_rank()
    _check_coords(layout, rank)
    _check_layers(layout, spec, chunks, rank)
    served = _serve([(layout.chunk_prefix(c), layout.chunk_prefix(c), chunk) for c, chunk in enumerate(chunks)],
                    spec, layout, rank)
    return start_trainer(address, group=group, rank=rank, spec=spec, layout=layout, served=served, token=token,
                         **agent_options)


def attach_mtp(model: torch.nn.Module | Sequence[torch.nn.Module], address: str | None = None, *, group: str,
               spec: str | Mapping[str, Any], token: str | None = None, **agent_options: Any) -> TrainerAgent | None:
    """Register the multi-token-prediction layers (``mtp.*``) of this rank's megatron-core
    ``GPTModel`` (or chunks, as `attach` takes them) as a rank of trainer group ``group``: the
    drafter a speculative vLLM engine's draft group is refitted from.  Call on every rank, beside
    `attach`; ranks off the last pipeline stage hold no MTP layer and get ``None``.  ``spec``: the
    policy's HF directory, catalog name or config.json dict (DeepSeek-V3 / Kimi-K2 / GLM-4.5 with
    ``num_nextn_predict_layers``: the MTP layers' shapes and which of them are MoE come from it).
    Raises `refit.InvalidInput`, before registering, for a model whose MTP layers differ from it."""
    target, drafter = _mtp_specs(spec)
    chunks = [_unwrap(m) for m in _wrappers(model)]
    _check_config(chunks, target)
    built = getattr(chunks[0].config, "mtp_num_layers", None) or 0
    if built != target.config.num_mtp_layers:
        raise InvalidInput(f"megatron config mtp_num_layers is {built}, {target.name} has "
                           f"{target.config.num_mtp_layers} MTP layer(s) (num_nextn_predict_layers)")
    layout = layout_from_parallel_state(target, chunks)
    rank = global_rank()
    _check_coords(layout, rank)
    if layout.coords(rank)["pp"] != layout.pp - 1:
        log.debug("rank %d: no MTP layers off the last pipeline stage; not in group %s", rank, group)
        return None
    stage = MegatronLayout(tp=layout.tp, ep=layout.ep, etp=layout.etp, dp=layout.dp, cp=layout.cp,
                           local=layout.local).resolve(drafter)
    stage_rank = rank - (layout.pp - 1) * stage.world_size  # the stage's ranks, numbered from 0 in the same order
    last = chunks[-1]
    _check_mtp_layers(last, drafter)
    served = _serve([("", layout.chunk_prefix(len(chunks) - 1), last)], drafter, stage, stage_rank, mtp=True)
    return start_trainer(address, group=group, rank=stage_rank, spec=drafter, layout=stage, served=served, token=token,
                         **agent_options)


def _mtp_specs(model: str | Mapping[str, Any]) -> tuple[ModelSpec, ModelSpec]:
    """(the policy's spec, its MTP layers' drafter spec) from an HF directory, catalog name or config dict."""
    if isinstance(model, str):
        target = load_spec(model)
        hf = dict(hf_config(model, target))
        if "torch_dtype" not in hf and "dtype" not in hf:  # a directory whose dtype came from its headers
            hf["torch_dtype"] = target.config.dtype
        name = target.name
    else:
        hf = dict(model)
        name = str(hf.get("_name_or_path") or hf.get("model_type") or "model").rstrip("/").rsplit("/", 1)[-1]
        target = build_spec(name, ModelConfig.from_hf(hf))
    return target, build_spec(f"{name}-mtp", mtp_config(hf))


def _check_mtp_layers(chunk: torch.nn.Module, drafter: ModelSpec) -> None:
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


def _wrappers(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The model chunks as given: a list of virtual-pipeline chunks, or one model."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _unwrap(m: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Megatron's DistributedDataParallel / Float16Module wrappers."""
    while not hasattr(m, "decoder") and isinstance(getattr(m, "module", None), torch.nn.Module):
        m = m.module
    if not hasattr(m, "decoder"):
        raise InvalidInput(f"{type(m).__name__} is not a megatron-core GPTModel (no .decoder)")
    return m


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
    `_check_vocab` refuses it with the numbers."""
    if padded is None or padded == pad_to(vocab, VOCAB_DIVISIBLE_BY * tp):
        return VOCAB_DIVISIBLE_BY
    if padded % tp == 0:
        for d in range(1, padded // tp + 1):
            if pad_to(vocab, d * tp) == padded:
                return d
    return VOCAB_DIVISIBLE_BY


def _check_coords(layout: MegatronLayout, rank: int) -> None:
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


def _check_config(chunks: Sequence[torch.nn.Module], spec: ModelSpec) -> None:
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


def _check_vocab(chunks: Sequence[torch.nn.Module], spec: ModelSpec, layout: MegatronLayout) -> None:
    """The model's (padded) vocabulary against the rows refit's layout gives the embedding."""
    want = pad_to(spec.config.vocab_size, layout.vocabdiv * layout.tp)
    got = getattr(chunks[0], "vocab_size", want)
    if got != want:
        raise InvalidInput(f"megatron model vocab_size (padded) is {got}, {spec.name}'s vocab {spec.config.vocab_size} "
                         f"padded to a multiple of {layout.vocabdiv}*tp{layout.tp} is {want} "
                         f"(make_vocab_size_divisible_by {layout.vocabdiv})")


def _check_layers(layout: MegatronLayout, spec: ModelSpec, chunks: Sequence[torch.nn.Module], rank: int) -> None:
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


def _serve(parts: Sequence[tuple[str, str, torch.nn.Module]], spec: ModelSpec, layout: MegatronLayout, rank: int,
           *, mtp: bool = False) -> dict[str, Served]:
    """The live parameters refit's ``layout`` holds on ``rank``, from ``parts``: (local-name prefix,
    the prefix naming it to the user, GPTModel).  The policy's (everything but the MTP layers and
    their embedding copy), or with ``mtp`` the MTP layers' (``mtp.*``)."""
    expected = {lt.name: lt.shape for lt in layout.local_tensors(spec, rank)}
    served: dict[str, Served] = {}
    unmapped: list[str] = []
    misshaped: list[str] = []
    not_moved: list[str] = []
    for local_prefix, shown, chunk in parts:
        paths = ParameterPaths(chunk)  # a parameter replaced since attach is read at its path
        live = [(name, (lambda now=paths.follow(p): now().detach())) for name, p in chunk.named_parameters()]
        for name, module in chunk.named_modules():
            if getattr(module, "expert_bias", None) is not None:  # TopKRouter's buffer (not a parameter)
                getattr(module, "_maintain_float32_expert_bias", lambda: None)()
                live.append((f"{name}.expert_bias", (lambda m=module: m.expert_bias.detach())))
        # the embedding copy Megatron gives the MTP layers on a stage without the embedding: the policy's
        mtp_emb = "embedding.word_embeddings.weight" if getattr(chunk, "mtp_process", False) and \
            not getattr(chunk, "pre_process", True) else None
        for name, get in live:
            if name == mtp_emb or name.startswith("mtp.") != mtp:
                if not mtp:
                    not_moved.append(shown + name)
                continue
            local = _local_name(local_prefix, name, expected)
            if local is None:
                unmapped.append(shown + name)
            elif tuple(get().shape) != tuple(expected[local]):
                misshaped.append(f"{shown + name} {list(get().shape)} where refit's {local} is {list(expected[local])}")
            else:
                served[local] = Served(shown + name, get)
    refuse_unmapped(unmapped, f"{spec.name} on rank {rank} of {layout.describe()}", _hint(unmapped))
    if misshaped:
        down = any("_down_proj" in m for m in misshaped)
        raise InvalidInput(f"{spec.name} on rank {rank} of {layout.describe()}: {len(misshaped)} parameter(s) are "
                         f"shaped otherwise than refit holds them: {'; '.join(misshaped[:4])}"
                         f"{'...' if len(misshaped) > 4 else ''}"
                         + ("; MLA's down-projections: whole on every tp rank under the Transformer Engine spec "
                            "(TELinear, duplicated), split by rows over tp under the local spec (ColumnParallelLinear, "
                            f"layout local1); this layout expects {'split' if layout.local else 'whole'} ones"
                            if down else ""))
    if not_moved:
        log.info("rank %d: %d multi-token-prediction parameter(s) not moved with the policy (refit_megatron.attach_mtp "
                 "serves the MTP layers as a drafter): %s%s", rank, len(not_moved), ", ".join(not_moved[:3]),
                 "..." if len(not_moved) > 3 else "")
    return served


def _local_name(prefix: str, name: str, expected: Container[str]) -> str | None:
    if prefix + name in expected:
        return prefix + name
    for pattern, te in _LOCAL_TO_TE:
        if pattern.match(name):
            candidate = prefix + pattern.sub(te, name)
            if candidate in expected:
                return candidate
    return None


def _hint(unmapped: list[str]) -> str:
    first = unmapped[0] if unmapped else ""
    if re.search(r"\.experts\.weight[12]$", first):
        return "the legacy GroupedMLP (moe_grouped_gemm with the local spec) is not supported: use TE's grouped GEMM " \
               "or SequentialMLP"
    if first.endswith("bias") or "bias" in first:
        return "refit's models hold no linear biases besides q/k/v (add_bias_linear is not supported)"
    if "shared_experts.gate" in first:
        return "a shared-expert gate (moe_shared_expert_gate) is in none of the models refit knows"
    return "refit knows the Transformer Engine and local spec names of Llama, Qwen, DeepSeek-V3 and GLM-4.5 models"
