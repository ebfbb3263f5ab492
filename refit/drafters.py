"""Speculative drafters trained beside the policy, as refit models: MTP layers and EAGLE heads.

A drafter is a model of its own in refit's terms (a `ModelConfig` with ``drafter`` set, its own
spec and digest), refitted into its own engine group (``<group>-draft``) in the same version as
the target (`refit.integrations.vllm.draft`).  Its canonical tensors are named as the trainer's
checkpoint names them:

* ``mtp`` — the multi-token-prediction layers of DeepSeek-V3 (Kimi-K2, Moonlight) and GLM-4.5,
  ``model.layers.{N}.*`` for ``N`` in ``num_hidden_layers .. + num_nextn_predict_layers - 1``: per
  layer ``enorm``, ``hnorm``, ``eh_proj`` ([H, 2H]), ``shared_head.norm`` and a whole decoder layer
  (MLA or GQA attention, and the MoE or dense MLP vLLM's ``DeepseekV2DecoderLayer`` /
  ``Glm4MoeDecoderLayer`` builds at that index: the target's ``first_k_dense_replace`` /
  ``moe_layer_freq`` rule).  *Not* moved with the drafter: each MTP
  layer's ``embed_tokens`` and ``shared_head.head`` — vLLM's MTP proposer replaces them with the
  target's embedding and LM head (``_maybe_share_embeddings`` / ``_maybe_share_lm_head``), so the
  target's refit (``model.embed_tokens.weight``, ``lm_head.weight``) moves them, once (`MTP_SHARED`).
* ``eagle`` — an EAGLE-1 head of a Llama target (vLLM's ``EagleLlamaForCausalLM``): ``fc``
  ([H, 2H]) and ``num_hidden_layers`` decoder layers, the first without ``input_layernorm`` (EAGLE
  feeds ``fc``'s output straight in).  EAGLE checkpoints name them ``fc.weight`` /
  ``layers.{i}.*``; vLLM's loader prefixes ``model.``, and so do refit's canonical names
  (`eagle_canonical`).  The embedding and LM head are the target's in vLLM when the head has none of
  its own (or an identical copy): not moved with the drafter either.

The config of a drafter comes from the target's HF config (MTP) or the head's (EAGLE); a drafter
of another shape than the engine's is then refused when the plan is made, naming every field that
differs, as for any two models.  Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from refit.archs import FAMILY_ARCHS, family_fields, gqa_tensors, mla_tensors, moe_extra_tensors, mtp_layer_of
from refit.errors import InvalidInput
from refit.model_config import ModelConfig

MTP, EAGLE = "mtp", "eagle"
DRAFTERS = (MTP, EAGLE)
# vLLM's speculative methods (SpeculativeConfig.method, after its normalisation: deepseek_mtp -> mtp)
# whose drafter each kind is
METHOD_DRAFTER = {"mtp": MTP, "deepseek_mtp": MTP, "eagle": EAGLE}
MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the target's in vLLM: moved by its refit
EAGLE_ARCHS = ("llama",)  # vLLM 0.32's EagleLlamaForCausalLM (EAGLE-1 heads of Llama targets)

PerLayer = Callable[..., None]
Single = Callable[[str, tuple[int, ...]], None]


def mtp_layers(cfg: Any) -> tuple[int, ...]:
    """The global layer indices of the MTP layers (after the target's decoder layers)."""
    return tuple(range(cfg.num_layers, cfg.num_layers + cfg.num_mtp_layers))


def mtp_config(target_hf: dict[str, Any]) -> ModelConfig:
    """The `ModelConfig` of the MTP layers of the model of HF config ``target_hf`` (a DeepSeek-V3
    family config.json with ``num_nextn_predict_layers``, and the dtype: ``torch_dtype``)."""
    target = ModelConfig.from_hf(target_hf)
    if target.arch not in FAMILY_ARCHS:
        raise InvalidInput(f"MTP layers of model_type {target.arch!r}: refit lands DeepSeek-V3's and GLM-4.5's "
                           f"({', '.join(FAMILY_ARCHS)})")
    if not target.num_mtp_layers:
        raise InvalidInput(f"{target.arch}: num_nextn_predict_layers is 0: the model has no MTP layers")
    if target.quantization:
        raise InvalidInput(f"MTP layers served quantized ({target.quantization}) are not landed by refit")
    # vLLM builds each MTP layer as a DeepseekV2DecoderLayer / Glm4MoeDecoderLayer of its global
    # index: the target's rule of which layers are MoE, applied past num_hidden_layers
    every = family_fields(target_hf, target.num_layers + target.num_mtp_layers, target.num_heads)["moe_layers"]
    moe = tuple(layer for layer in every if layer >= target.num_layers)
    return dataclasses.replace(target, drafter=MTP, moe_layers=moe, tie_embeddings=False)


def eagle_config(head_hf: dict[str, Any]) -> ModelConfig:
    """The `ModelConfig` of an EAGLE head of HF config ``head_hf`` (the head's config.json: a
    Llama of ``num_hidden_layers`` layers, and the dtype)."""
    head = ModelConfig.from_hf(head_hf)
    if head.arch not in EAGLE_ARCHS:
        raise InvalidInput(f"EAGLE head of model_type {head.arch!r}: refit lands EAGLE heads of "
                           f"{', '.join(EAGLE_ARCHS)} (vLLM's EagleLlamaForCausalLM)")
    if head.quantization:
        raise InvalidInput(f"an EAGLE head served quantized ({head.quantization}) is not landed by refit")
    return dataclasses.replace(head, drafter=EAGLE, tie_embeddings=False)


def drafter_config(method: str, target_hf: dict[str, Any], draft_hf: dict[str, Any]) -> ModelConfig:
    """The `ModelConfig` of the drafter of vLLM speculative ``method``: from the target's HF
    config (MTP layers live in the target's checkpoint) or the draft's (an EAGLE head)."""
    kind = METHOD_DRAFTER.get(method)
    if kind == MTP:
        return mtp_config(target_hf)
    if kind == EAGLE:
        return eagle_config(draft_hf)
    raise InvalidInput(f"speculative method {method!r}: refit lands {', '.join(sorted(METHOD_DRAFTER))} drafters "
                       f"(and a separate draft model, draft_model)")


def drafter_tensors(cfg: Any, per_layer: PerLayer, single: Single) -> None:
    """The canonical tensors of drafter ``cfg`` (`refit.spec.build_spec`'s callbacks), in order."""
    if cfg.drafter == MTP:
        _mtp_tensors(cfg, per_layer)
    elif cfg.drafter == EAGLE:
        _eagle_tensors(cfg, per_layer, single)
    else:
        raise InvalidInput(f"drafter {cfg.drafter!r}: refit knows {', '.join(DRAFTERS)}")
    if cfg.lora is not None:
        raise InvalidInput("a drafter's LoRA adapter is not landed by refit")


def _mtp_tensors(cfg: Any, per_layer: PerLayer) -> None:
    H, layers = cfg.hidden_size, mtp_layers(cfg)
    moe = tuple(layer for layer in cfg.moe_layers if layer in layers)
    dense = tuple(layer for layer in layers if layer not in moe)

    def mtp(suffix: str, shape: tuple[int, ...], these: tuple[int, ...] = layers, dtype: str | None = None) -> None:
        per_layer(suffix, shape, these, dtype or cfg.dtype)

    mtp("input_layernorm.weight", (H,))
    if cfg.is_mla:
        mla_tensors(cfg, mtp)
    else:  # GLM-4.5: GQA with its qkv bias / qk norm
        gqa_tensors(cfg, mtp)
    mtp("post_attention_layernorm.weight", (H,))
    mtp("mlp.gate_proj.weight", (cfg.intermediate_size, H), dense)
    mtp("mlp.up_proj.weight", (cfg.intermediate_size, H), dense)
    mtp("mlp.down_proj.weight", (H, cfg.intermediate_size), dense)
    if moe and cfg.num_experts:
        E, inter = cfg.num_experts, cfg.moe_intermediate_size
        mtp("mlp.gate.weight", (E, H), moe)
        mtp("mlp.experts.*.gate_proj.weight", (E, inter, H), moe)
        mtp("mlp.experts.*.up_proj.weight", (E, inter, H), moe)
        mtp("mlp.experts.*.down_proj.weight", (E, H, inter), moe)
        moe_extra_tensors(cfg, mtp)
    for own in MTP_OWN:
        mtp(own, (H, 2 * H) if own == "eh_proj.weight" else (H,))


def _eagle_tensors(cfg: Any, per_layer: PerLayer, single: Single) -> None:
    H, inter = cfg.hidden_size, cfg.intermediate_size
    every = tuple(range(cfg.num_layers))
    per_layer("input_layernorm.weight", (H,), every[1:])  # layer 0 has none (vLLM: nn.Identity)
    gqa_tensors(cfg, per_layer)
    per_layer("post_attention_layernorm.weight", (H,))
    per_layer("mlp.gate_proj.weight", (inter, H))
    per_layer("mlp.up_proj.weight", (inter, H))
    per_layer("mlp.down_proj.weight", (H, inter))
    single("model.fc.weight", (H, 2 * H))


def eagle_canonical(name: str) -> str:
    """refit's (and vLLM's) name of an EAGLE checkpoint tensor: ``fc.weight`` -> ``model.fc.weight``,
    ``layers.0.*`` -> ``model.layers.0.*``; names already prefixed stay."""
    return name if name.startswith("model.") else f"model.{name}"


def moved_by_target(cfg: Any, name: str) -> bool:
    """Whether tensor ``name`` of drafter ``cfg``'s checkpoint is one vLLM's drafter takes from the
    target (an MTP layer's ``embed_tokens`` / ``shared_head.head``, an EAGLE head's embedding or LM
    head copy): the target's refit moves it, the drafter's does not."""
    if cfg.drafter == MTP:
        return any(name == f"model.layers.{layer}.{s}" for layer in mtp_layers(cfg) for s in MTP_SHARED)
    if cfg.drafter == EAGLE:
        return eagle_canonical(name) in ("model.embed_tokens.weight", "model.lm_head.weight")
    return False


def shared_with_target(cfg: Any) -> tuple[str, ...]:
    """What a drafter's checkpoint may hold that refit does not move with the drafter (the target's
    refit moves it: vLLM's drafter holds the target's), said plainly."""
    if cfg.drafter == MTP:
        where = ", ".join(f"model.layers.{layer}.{{{','.join(MTP_SHARED)}}}" for layer in mtp_layers(cfg))
        return (f"{where}: vLLM's MTP drafter holds the target's embedding and LM head; the target's refit "
                f"moves model.embed_tokens.weight and lm_head.weight",)
    if cfg.drafter == EAGLE:
        return ("embed_tokens.weight, lm_head.weight: vLLM's EAGLE drafter holds the target's (a head with none of "
                "its own, or an identical copy); the target's refit moves them",)
    return ()


# What a checkpoint holds that a model's refit does not move: here, beside the drafters that do
# move it, rather than in `refit.archs`, whose tensor builders this module calls.
def is_not_moved(cfg: Any, name: str) -> bool:
    """Whether HF checkpoint tensor ``name`` is one `not_moved` speaks of: an MTP layer's of the
    model, or, for a drafter's own spec, one the target's refit moves instead."""
    if getattr(cfg, "drafter", ""):
        return moved_by_target(cfg, name)
    return mtp_layer_of(cfg, name) is not None


def not_moved(cfg: Any) -> tuple[str, ...]:
    """What a checkpoint of this model may hold that refit does not move, said plainly."""
    if getattr(cfg, "drafter", ""):  # a drafter's own spec: what the target's refit moves instead
        return shared_with_target(cfg)
    if not cfg.num_mtp_layers:
        return ()
    lo, hi = cfg.num_layers, cfg.num_layers + cfg.num_mtp_layers - 1
    where = f"model.layers.{lo}.*" if lo == hi else f"model.layers.{lo}..{hi}.*"
    # (this text is part of plan summaries, whose hashes tests/unit/test_plan_stability.py pins;
    # the MTP drafter's own spec holds these layers: `mtp_config`)
    return (f"{where}: {cfg.num_mtp_layers} multi-token-prediction layer(s) (num_nextn_predict_layers) are not "
            f"moved; vLLM's main model skips them and holds them only in its MTP drafter",)
