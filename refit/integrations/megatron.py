"""Attach a megatron-core GPTModel (or its list of virtual-pipeline chunks) to the refit control plane.

    from refit.integrations import megatron as refit_megatron
    agent = refit_megatron.attach(model, "127.0.0.1:50051", group="trainer", spec="/path/to/hf_dir")

Called on every rank after ``parallel_state.initialize_model_parallel`` (and after wrapping the
model in Megatron's DDP, whose buffers the parameters then live in).  The layout is read from
``megatron.core.parallel_state`` (tp, pp, vpp, ep, etp, cp, dp) and the config's uneven pipeline
split (``num_layers_in_first/last_pipeline_stage`` or ``account_for_embedding/loss_in_pipeline_split``),
then checked against the model itself: this rank's coordinates, the layers each chunk
built, the config's dimensions against the spec's (both in `refit.integrations.megatron_checks`;
this module serves the parameters).

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
(`refit.integrations.megatron_checks.split_down_projections`; ``local1`` in the layout it
registers).

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
from refit.drafters import mtp_config
from refit.errors import InvalidInput
from refit.integrations._common import ParameterPaths, Served, global_rank, refuse_unmapped, start_trainer
from refit.integrations.megatron_checks import (check_config, check_coords, check_layers, check_mtp_layers,
                                                check_vocab, layout_from_parallel_state)
from refit.layouts import MegatronLayout
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
    check_config(chunks, spec)
    layout = layout_from_parallel_state(spec, chunks)
    check_vocab(chunks, spec, layout)
    rank = global_rank()
    check_coords(layout, rank)
    check_layers(layout, spec, chunks, rank)
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
    check_config(chunks, target)
    built = getattr(chunks[0].config, "mtp_num_layers", None) or 0
    if built != target.config.num_mtp_layers:
        raise InvalidInput(f"megatron config mtp_num_layers is {built}, {target.name} has "
                           f"{target.config.num_mtp_layers} MTP layer(s) (num_nextn_predict_layers)")
    layout = layout_from_parallel_state(target, chunks)
    rank = global_rank()
    check_coords(layout, rank)
    if layout.coords(rank)["pp"] != layout.pp - 1:
        log.debug("rank %d: no MTP layers off the last pipeline stage; not in group %s", rank, group)
        return None
    stage = MegatronLayout(tp=layout.tp, ep=layout.ep, etp=layout.etp, dp=layout.dp, cp=layout.cp,
                           local=layout.local).resolve(drafter)
    stage_rank = rank - (layout.pp - 1) * stage.world_size  # the stage's ranks, numbered from 0 in the same order
    last = chunks[-1]
    check_mtp_layers(last, drafter)
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
