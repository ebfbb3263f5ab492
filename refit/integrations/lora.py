"""LoRA merged on the way: a PEFT LoRA model served as the merged weights ``W + scaling · B·A``.

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
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from refit.errors import InvalidInput

__all__ = ["is_lora_model", "merged_parameters"]

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
