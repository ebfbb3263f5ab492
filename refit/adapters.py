"""LoRA adapters as refit models: the canonical tensors of one adapter of a base model.

An adapter-only refit moves a LoRA adapter's A and B matrices, nothing of the base model.  Its
spec is the base model's `ModelConfig` with its ``lora`` set to a `LoraAdapter` (rank, targets,
scaling), so a registration carries it like any model (`refit.control.common`'s ``config_json``)
and the coordinator refuses a trainer and an engine that disagree on any of them, naming the field
and both values (``lora.scaling 4.0 vs 2.0``), before a plan exists.  The tensors, in HF naming
(PEFT's saved adapter names without the ``base_model.model.`` prefix), stacked over layers as
every per-layer tensor is:

* ``model.layers.*.self_attn.q_proj.lora_A.weight`` ``[L, r, H]`` and ``...lora_B.weight``
  ``[L, nq*hd, r]``; likewise ``k_proj`` / ``v_proj`` / ``o_proj`` and the MLP's
  ``gate_proj`` / ``up_proj`` / ``down_proj`` that the adapter targets.

The scaling is PEFT's ``scaling`` (``lora_alpha / r``, rsLoRA ``lora_alpha / sqrt(r)``), one
for every module: B travels unscaled, and the engine folds the scaling in where its own loader
does.  Dense GQA models only (Llama, Qwen2, Qwen3): MoE experts and MLA attention are refused.

The spec of an adapter is `refit.spec.adapter_spec`: `refit.spec.build_spec` calls
`adapter_tensors`, so this module sits below the spec builder and imports only the config.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from refit.errors import InvalidInput
from refit.model_config import LoraAdapter, ModelConfig

# The modules an adapter may target, in canonical order -> the submodule holding each
ATTENTION, MLP = "self_attn", "mlp"
TARGETS: dict[str, str] = {"q_proj": ATTENTION, "k_proj": ATTENTION, "v_proj": ATTENTION, "o_proj": ATTENTION,
                           "gate_proj": MLP, "up_proj": MLP, "down_proj": MLP}
ADAPTER_ARCHS = ("llama", "qwen2", "qwen3")


def target_shape(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(output rows, input columns) of the base linear layer ``target``."""
    H, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    return {"q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H), "o_proj": (H, q),
            "gate_proj": (inter, H), "up_proj": (inter, H), "down_proj": (H, inter)}[target]


def tensor_name(target: str, which: str) -> str:
    """The canonical (stacked) name of ``target``'s ``lora_A`` / ``lora_B`` matrix."""
    return f"model.layers.*.{TARGETS[target]}.{target}.{which}.weight"


def check_adapter(cfg: ModelConfig) -> LoraAdapter:
    """``cfg``'s adapter; refuses an adapter config refit cannot describe, naming the numbers."""
    lora = cfg.lora
    if lora is None:
        raise InvalidInput(f"adapter: the {cfg.arch} config holds no LoRA adapter")
    if cfg.arch not in ADAPTER_ARCHS or cfg.is_moe or cfg.is_mla:
        raise InvalidInput(f"adapter-only refits hold LoRA of dense GQA models ({', '.join(ADAPTER_ARCHS)}); "
                           f"{cfg.arch}{' (MoE)' if cfg.is_moe else ''} is not one")
    if lora.rank < 1:
        raise InvalidInput(f"adapter: LoRA rank {lora.rank}; expected at least 1")
    targets = lora.targets
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise InvalidInput(f"adapter: target modules {list(targets)}; refit moves LoRA of {', '.join(TARGETS)} "
                           f"(each on every layer){f', not {unknown}' if unknown else ''}")
    if list(targets) != sorted(targets, key=list(TARGETS).index) or len(set(targets)) != len(targets):
        raise InvalidInput(f"adapter: target modules {list(targets)} must be listed once each, in the order "
                           f"{', '.join(TARGETS)} (`adapter_config`)")
    if not (math.isfinite(lora.scaling) and lora.scaling > 0):
        raise InvalidInput(f"adapter: LoRA scaling {lora.scaling}; expected a finite positive number")
    return lora


def adapter_tensors(cfg: ModelConfig, per_layer: Callable[..., None]) -> None:
    """The adapter's canonical tensors (``per_layer(suffix, shape)`` as in `refit.spec.build_spec`)."""
    lora = check_adapter(cfg)
    r = lora.rank
    for target in lora.targets:
        rows, cols = target_shape(cfg, target)
        per_layer(f"{TARGETS[target]}.{target}.lora_A.weight", (r, cols))
        per_layer(f"{TARGETS[target]}.{target}.lora_B.weight", (rows, r))


def adapter_config(base: ModelConfig, rank: int, targets: list[str] | tuple[str, ...], scaling: float,
                   dtype: str | None = None) -> ModelConfig:
    """``base``'s config describing one adapter of it (targets put in canonical order)."""
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise InvalidInput(f"adapter: target modules {unknown} are none of the modules refit moves LoRA of "
                           f"({', '.join(TARGETS)}): the adapter cannot be refitted")
    ordered = tuple(t for t in TARGETS if t in set(targets))
    cfg = dataclasses.replace(base, lora=LoraAdapter(int(rank), ordered, float(scaling)), dtype=dtype or base.dtype)
    check_adapter(cfg)
    return cfg
