"""LoRA from a PEFT model: merged on the way (``lora="merge"``) or the adapter alone (``adapter=``).

**Merged.**  A PEFT LoRA model served as the merged weights ``W + scaling · B·A``.

    from refit.integrations import hf as refit_hf
    agent = refit_hf.attach(peft_model, "127.0.0.1:50051", group="trainer", lora="merge")

The engine holds no LoRA: it serves the merged model, as it would after loading the checkpoint of
``peft_model.merge_and_unload()``.  At every refit each LoRA layer's merged weight is computed into
a buffer of its own (one per layer, allocated at attach, so the plan's transfers stay valid), with
PEFT's own ``get_delta_weight`` and the same add as PEFT's default merge (``weight += delta``:
the sum in the wider dtype, rounded once to the weight's), so the engine holds what that
checkpoint would hold, bit for bit.  The other parameters are served as views, as ever; the
trainer's parameters are never changed.  Extra memory: one copy of the LoRA layers' base weights.

Refused, naming the layer: LoRA on a layer other than ``nn.Linear`` (embeddings, convolutions),
several active adapters, DoRA and other variants, ``lora_bias``, adapters already merged into the
base weights.

**The adapter alone.**

    agent = refit_hf.attach(peft_model, "127.0.0.1:50051", group="trainer", adapter="policy")

Serves only adapter ``policy``'s A and B matrices (views of the live LoRA parameters, in the dtype
PEFT keeps them: float32 under a bfloat16 base by default; plans cast on the way), under the spec
of `refit.adapters` (the base config plus rank, targets and scaling).  The engines hold the same
adapter in vLLM's LoRA slots (`refit.integrations.vllm.lora_slot`).  Refused, naming the layer and
the numbers: a target other than the q/k/v/o and gate/up/down projections (embeddings, lm_head),
a target on some layers only, ranks or scalings that differ between layers (``rank_pattern`` /
``alpha_pattern``: refit's adapter spec holds one of each), DoRA and other variants, ``lora_bias``,
an adapter merged into the base weights, ``modules_to_save``.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from refit.errors import InvalidInput

__all__ = ["is_lora_model", "merged_parameters", "adapter_parameters"]

_ADAPTER_PARAM = re.compile(r"\.lora_[A-Za-z_]+\.")  # lora_A / lora_B / lora_embedding_* / lora_magnitude_vector


def _lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def is_lora_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a PEFT model or a model PEFT injected LoRA layers into) holds LoRA layers."""
    return bool(_lora_layers(model))


def merged_parameters(model: torch.nn.Module) -> tuple[torch.nn.Module, list[tuple[str, torch.Tensor]],
                                                        dict[str, Callable[[], torch.Tensor]]]:
    """(the transformers model inside ``model``, its parameters under HF names without the
    adapters, HF name -> the merged weight of each LoRA layer computed now)."""
    base = getattr(getattr(model, "base_model", None), "model", model)  # PeftModel -> LoraModel -> model
    layers = _lora_layers(base)
    if not layers:
        raise InvalidInput("lora='merge': the model holds no LoRA layers (a PEFT LoraConfig model)")
    merged: dict[str, Callable[[], torch.Tensor]] = {}
    for name, layer in layers.items():
        merged[f"{name}.weight"] = _merged_weight(name, layer)
    named = [(n.replace(".base_layer.", "."), p) for n, p in base.named_parameters(remove_duplicate=False)
             if not _ADAPTER_PARAM.search(n)]
    return base, named, merged


def _merged_weight(name: str, layer: torch.nn.Module) -> Callable[[], torch.Tensor]:
    base_layer = layer.get_base_layer()
    if type(base_layer) is not torch.nn.Linear:
        raise InvalidInput(f"lora='merge': {name!r} puts LoRA on a {type(base_layer).__name__}; only nn.Linear "
                           f"layers are merged on the way")
    active = list(layer.active_adapters)
    if len(active) != 1:
        raise InvalidInput(f"lora='merge': {name!r} has {len(active)} active adapters {active}; one is merged")
    adapter = active[0]
    if adapter in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(adapter):
        raise InvalidInput(f"lora='merge': {name!r} uses a LoRA variant (DoRA, ...) for adapter {adapter!r}; plain "
                           f"LoRA only")
    if getattr(layer, "lora_bias", {}).get(adapter):
        raise InvalidInput(f"lora='merge': {name!r} has lora_bias for adapter {adapter!r}; not merged on the way")
    if layer.merged:
        raise InvalidInput(f"lora='merge': {name!r} already has adapters merged into its base weight "
                           f"({layer.merged_adapters}); unmerge them first")
    out = torch.empty_like(base_layer.weight, memory_format=torch.contiguous_format)

    def compute() -> torch.Tensor:
        # the base weight as it lies now (attach follows storage); PEFT's default merge: weight +=
        # delta (summed wide, rounded once)
        with torch.no_grad():
            torch.add(base_layer.weight.detach(), layer.get_delta_weight(adapter), out=out)
        return out

    return compute


def adapter_parameters(model: torch.nn.Module, adapter: str) -> tuple[torch.nn.Module, list[tuple[str, torch.Tensor]],
                                                                       int, list[str], float]:
    """(the transformers model inside ``model``, adapter ``adapter``'s LoRA parameters under
    refit's adapter names (``model.layers.0.self_attn.q_proj.lora_A.weight``), its rank, targets
    and scaling); refuses what refit's adapter spec cannot describe (module docstring)."""
    from refit.adapters import TARGETS

    base = getattr(getattr(model, "base_model", None), "model", model)
    layers = {n: m for n, m in _lora_layers(base).items()
              if adapter in getattr(m, "lora_A", {}) or adapter in getattr(m, "lora_embedding_A", {})}
    if not layers:
        known = sorted(getattr(model, "peft_config", {}) or {})
        raise InvalidInput(f"adapter={adapter!r}: no LoRA layer holds that adapter (the model's adapters: {known})")
    cfg = (getattr(model, "peft_config", None) or {}).get(adapter)
    if cfg is not None and getattr(cfg, "modules_to_save", None):
        raise InvalidInput(f"adapter={adapter!r}: modules_to_save {sorted(cfg.modules_to_save)} are whole modules, "
                           f"not LoRA: an adapter-only refit moves A and B matrices only")
    named: list[tuple[str, torch.Tensor]] = []
    held: dict[str, set[int]] = {}
    ranks: dict[str, int] = {}
    scalings: dict[str, float] = {}
    for name, layer in layers.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)", name)
        if m is None or m[3] not in TARGETS or TARGETS[m[3]] != m[2] or adapter not in layer.lora_A:
            raise InvalidInput(f"adapter={adapter!r}: LoRA on {name!r}; refit moves LoRA of the q/k/v/o and "
                               f"gate/up/down projections only ({', '.join(TARGETS)})")
        _check_plain(f"adapter={adapter!r}", name, layer, adapter)
        if adapter in layer.merged_adapters:
            raise InvalidInput(f"adapter={adapter!r}: {name!r} has it merged into its base weight; unmerge it first "
                               f"(the engine adds the adapter to the base weights it holds)")
        held.setdefault(m[3], set()).add(int(m[1]))
        ranks[name], scalings[name] = int(layer.r[adapter]), float(layer.scaling[adapter])
        named.append((f"{name}.lora_A.weight", layer.lora_A[adapter].weight))
        named.append((f"{name}.lora_B.weight", layer.lora_B[adapter].weight))
    layer_count = base.config.num_hidden_layers
    for target, got in held.items():
        if len(got) != layer_count:
            missing = sorted(set(range(layer_count)) - got)
            raise InvalidInput(f"adapter={adapter!r}: {target} holds LoRA on {len(got)} of {layer_count} layers "
                               f"(not on layers {missing[:8]}); refit's adapter spec puts each target on every layer")
    for what, values in (("rank", ranks), ("scaling", scalings)):
        if len(set(values.values())) > 1:
            (a, va), (b, vb) = next(iter(values.items())), next((k, v) for k, v in values.items()
                                                                 if v != next(iter(values.values())))
            raise InvalidInput(f"adapter={adapter!r}: LoRA {what} {va} on {a!r} but {vb} on {b!r} (rank_pattern / "
                               f"alpha_pattern); refit's adapter spec holds one {what} for every module")
    return base, named, next(iter(ranks.values())), sorted(held), next(iter(scalings.values()))


def _check_plain(mode: str, name: str, layer: torch.nn.Module, adapter: str) -> None:
    """Plain LoRA on an nn.Linear: no variant (DoRA, ...), no lora_bias."""
    base_layer = layer.get_base_layer()
    if type(base_layer) is not torch.nn.Linear:
        raise InvalidInput(f"{mode}: {name!r} puts LoRA on a {type(base_layer).__name__}; only nn.Linear layers")
    if adapter in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(adapter):
        raise InvalidInput(f"{mode}: {name!r} uses a LoRA variant (DoRA, ...) for adapter {adapter!r}; plain LoRA only")
    if getattr(layer, "lora_bias", {}).get(adapter):
        raise InvalidInput(f"{mode}: {name!r} has lora_bias for adapter {adapter!r}; vLLM's LoRA holds no bias")
