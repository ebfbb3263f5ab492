"""Model specs: the canonical tensors of a model, in Hugging Face naming.

A *canonical tensor* is the unit every layout is described against.  To keep plans small, refit
stacks what repeats:

* every per-layer tensor becomes one tensor with a leading layer dimension, named with a ``*``
  in place of the layer number: ``model.layers.*.self_attn.q_proj.weight`` is ``[L, nq*hd, H]``;
* MoE experts add an expert dimension: ``model.layers.*.mlp.experts.*.gate_proj.weight`` is
  ``[L_moe, E, I, H]``.

An HF checkpoint tensor (``model.layers.3.mlp.experts.7.gate_proj.weight``) is then one box of a
canonical tensor, and a vLLM rank's ``w13_weight`` for all layers is a handful of boxes instead of
thousands.  Nothing here imports torch: specs are pure data.  Reading a spec from an HF
checkpoint directory or the catalog (`load_spec`) lives in `refit.hf_checkpoint`.

`ModelConfig` lives in `refit.model_config` (re-exported here): `refit.adapters` and
`refit.drafters`, whose tensors `build_spec` lays out, read and build configs without this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from refit.adapters import adapter_config, adapter_tensors
from refit.archs import gqa_tensors, mla_tensors, moe_extra_tensors
from refit.drafters import drafter_tensors, not_moved
from refit.dtypes import DTYPE_BYTES
from refit.errors import InvalidInput
from refit.model_config import MUST_STATE, SUPPORTED_ARCHS, LoraAdapter, ModelConfig  # noqa: F401  re-exported: refit.spec's names
from refit.quantization import is_quantized, quant_format, scale_shape


@dataclass(frozen=True)
class TensorSpec:
    """One canonical tensor.  ``layers`` lists the global layer held at each index of dim 0 for
    stacked per-layer tensors (names containing ``model.layers.*``); it is empty otherwise."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layers: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    @property
    def is_experts(self) -> bool:
        return ".experts.*." in self.name

    def hf_name(self, layer: int | None = None, expert: int | None = None) -> str:
        name = self.name
        if layer is not None:
            name = name.replace("*", str(layer), 1)
        if expert is not None:
            name = name.replace("*", str(expert), 1)
        return name


@dataclass(frozen=True)
class HFTensor:
    """One tensor of an HF checkpoint: a box ``start/size`` of canonical ``tensor``."""

    name: str
    shape: tuple[int, ...]
    tensor: str
    start: tuple[int, ...]
    size: tuple[int, ...]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config: ModelConfig
    tensors: tuple[TensorSpec, ...] = field(repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tensors})
        layer_pos: dict[str, dict[int, int]] = {
            t.name: {l: i for i, l in enumerate(t.layers)} for t in self.tensors
        }
        object.__setattr__(self, "_layer_pos", layer_pos)

    def __getitem__(self, name: str) -> TensorSpec:
        return self._by_name[name]  # type: ignore[attr-defined]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name  # type: ignore[attr-defined]

    def layer_pos(self, name: str, layer: int) -> int:
        """Index along dim 0 of stacked tensor ``name`` where global ``layer`` lives."""
        return self._layer_pos[name][layer]  # type: ignore[attr-defined]

    @property
    def not_moved(self) -> tuple[str, ...]:
        """Checkpoint contents refit accepts but does not move (MTP layers), said plainly."""
        return not_moved(self.config)

    @property
    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def digest(self) -> str:
        """Identifies the model's tensors (names, shapes, dtypes) — equal on both ends of a refit."""
        blob = json.dumps([[t.name, list(t.shape), t.dtype] for t in self.tensors])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def hf_tensors(self) -> Iterator[HFTensor]:
        """The tensors of an ordinary HF checkpoint of this model, as boxes of canonical ones."""
        for t in self.tensors:
            if not t.layers:
                yield HFTensor(t.name, t.shape, t.name, (0,) * len(t.shape), t.shape)
                continue
            for pos, layer in enumerate(t.layers):
                if t.is_experts:
                    inner = t.shape[2:]
                    for e in range(t.shape[1]):
                        yield HFTensor(
                            t.hf_name(layer, e), inner, t.name, (pos, e) + (0,) * len(inner), (1, 1) + inner
                        )
                else:
                    inner = t.shape[1:]
                    yield HFTensor(t.hf_name(layer), inner, t.name, (pos,) + (0,) * len(inner), (1,) + inner)


def build_spec(name: str, cfg: ModelConfig) -> ModelSpec:
    """The canonical tensors of a model with config ``cfg``."""
    H, dt = cfg.hidden_size, cfg.dtype
    all_layers = tuple(range(cfg.num_layers))
    out: list[TensorSpec] = []

    def per_layer(suffix: str, shape: tuple[int, ...], layers: tuple[int, ...] = all_layers, dtype: str = dt) -> None:
        if layers:
            out.append(TensorSpec(f"model.layers.*.{suffix}", (len(layers),) + shape, dtype, layers))

    if cfg.lora is not None:  # one LoRA adapter of the model, nothing of the base (refit/adapters.py)
        if cfg.quantization:
            raise InvalidInput(f"adapter of {name}: LoRA adapters are moved unquantized")
        adapter_tensors(cfg, per_layer)
        return ModelSpec(name, cfg, tuple(out))
    if cfg.drafter:  # MTP layers or an EAGLE head alone (refit/drafters.py)
        drafter_tensors(cfg, per_layer, lambda n, shape: out.append(TensorSpec(n, shape, dt)))
        return ModelSpec(name, cfg, tuple(out))
    out.append(TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, H), dt))

    per_layer("input_layernorm.weight", (H,))
    if cfg.is_mla:
        mla_tensors(cfg, per_layer)
    else:
        gqa_tensors(cfg, per_layer)
    per_layer("post_attention_layernorm.weight", (H,))
    dense = cfg.dense_layers
    per_layer("mlp.gate_proj.weight", (cfg.intermediate_size, H), dense)
    per_layer("mlp.up_proj.weight", (cfg.intermediate_size, H), dense)
    per_layer("mlp.down_proj.weight", (H, cfg.intermediate_size), dense)
    if cfg.is_moe:
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        per_layer("mlp.gate.weight", (E, H), cfg.moe_layers)
        per_layer("mlp.experts.*.gate_proj.weight", (E, I, H), cfg.moe_layers)
        per_layer("mlp.experts.*.up_proj.weight", (E, I, H), cfg.moe_layers)
        per_layer("mlp.experts.*.down_proj.weight", (E, H, I), cfg.moe_layers)
        moe_extra_tensors(cfg, per_layer)
    out.append(TensorSpec("model.norm.weight", (H,), dt))
    if not cfg.tie_embeddings:
        out.append(TensorSpec("lm_head.weight", (cfg.vocab_size, H), dt))
    if cfg.quantization:
        return quantize_spec(ModelSpec(name, dataclasses.replace(cfg, quantization=""), tuple(out)), cfg.quantization)
    return ModelSpec(name, cfg, tuple(out))


def quantize_spec(spec: ModelSpec, fmt: str) -> ModelSpec:
    """The spec of ``spec`` served in quantized format ``fmt`` (`refit.quantization`): every
    covered weight in the format's value dtype, followed by its scale tensor."""
    if spec.config.quantization:
        raise InvalidInput(f"{spec.name} is already quantized ({spec.config.quantization})")
    f = quant_format(fmt)
    out: list[TensorSpec] = []
    for t in spec.tensors:
        if not is_quantized(t.name):
            out.append(t)
            continue
        if t.dtype != spec.config.dtype:
            raise InvalidInput(f"{t.name!r} is {t.dtype}, the model {spec.config.dtype}: refit quantizes weights "
                               f"held in the model's dtype only")
        out.append(TensorSpec(t.name, t.shape, f.value_dtype, t.layers))
        out.append(TensorSpec(t.name + f.scale_suffix, scale_shape(t.shape, f.block), f.scale_dtype, t.layers))
    return ModelSpec(spec.name, dataclasses.replace(spec.config, quantization=fmt), tuple(out))


def adapter_spec(base: ModelSpec, rank: int, targets: list[str] | tuple[str, ...], scaling: float,
                 dtype: str | None = None, name: str | None = None) -> ModelSpec:
    """The spec of a LoRA adapter of ``base`` (its tensors only; the base model's are not moved).
    Here rather than in `refit.adapters`, which `build_spec` calls: a spec is built above both."""
    if base.config.lora is not None:
        raise InvalidInput(f"{base.name} describes an adapter already")
    return build_spec(name or base.name, adapter_config(base.config, rank, targets, scaling, dtype))


def base_spec(spec: ModelSpec) -> ModelSpec:
    """The unquantized spec a quantized one was made from (``spec`` itself when unquantized)."""
    if not spec.config.quantization:
        return spec
    f = quant_format(spec.config.quantization)
    scales = {t.name + f.scale_suffix for t in spec.tensors if is_quantized(t.name)}
    tensors = tuple(TensorSpec(t.name, t.shape, spec.config.dtype, t.layers) if is_quantized(t.name) else t
                    for t in spec.tensors if t.name not in scales)
    return ModelSpec(spec.name, dataclasses.replace(spec.config, quantization=""), tensors)


TensorTable = Mapping[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype)


def check_tensor_table(found: TensorTable, expected: TensorTable, where: str, extra_ok: bool = False) -> None:
    """Refuse tensors that differ from what is expected — missing, wrong shape, wrong dtype, or
    (unless ``extra_ok``) unexpected — naming the first difference."""
    for name, (shape, dtype) in expected.items():
        if name not in found:
            raise InvalidInput(f"{where}: tensor {name!r} is missing")
        got_shape, got_dtype = found[name]
        if tuple(got_shape) != tuple(shape):
            raise InvalidInput(f"{where}: {name!r} has shape {list(got_shape)}, expected {list(shape)}")
        if got_dtype != dtype:
            raise InvalidInput(f"{where}: {name!r} is {got_dtype}, expected {dtype}")
    extra = [] if extra_ok else sorted(set(found) - set(expected))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise InvalidInput(f"{where}: unexpected tensor {extra[0]!r}{more}")
