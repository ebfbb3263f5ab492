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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from refit.adapters import adapter_tensors
from refit.archs import FAMILY_ARCHS, family_fields, gqa_tensors, mla_tensors, moe_extra_tensors, not_moved
from refit.dtypes import DTYPE_BYTES
from refit.errors import InvalidInput
from refit.quantization import from_hf_config, is_quantized, quant_format, scale_shape

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2", "glm4_moe")

# config.json keys refit will not guess.  Missing, transformers gives them its config class's
# defaults — the full-size model's values (Qwen3MoeConfig's 128 experts, DeepseekV3Config's 256,
# Qwen2Config's 32 kv heads) — and vLLM builds those shapes; refit's own fallbacks (0, the head
# count) would plan others.  Every key refit reads that is not listed falls back as transformers
# does (tests/unit/test_spec.py checks both against the installed transformers).  Alternatives:
# "a|b" — either name.
_MOE_FAMILY = ("n_routed_experts", "first_k_dense_replace", "moe_intermediate_size", "n_shared_experts")
MUST_STATE: dict[str, tuple[str, ...]] = {
    "llama": ("intermediate_size",),
    "qwen2": ("intermediate_size", "num_key_value_heads"),
    "qwen3": ("intermediate_size", "num_key_value_heads", "head_dim"),
    "qwen3_moe": ("intermediate_size", "num_key_value_heads", "num_experts|num_local_experts",
                  "moe_intermediate_size"),
    "deepseek_v3": ("intermediate_size", *_MOE_FAMILY, "q_lora_rank"),
    "kimi_k2": ("intermediate_size", *_MOE_FAMILY, "q_lora_rank"),
    "glm4_moe": ("intermediate_size", "num_key_value_heads", *_MOE_FAMILY),
}


@dataclass(frozen=True)
class ModelConfig:
    """The numbers that decide every tensor's shape and how frameworks split it."""

    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    # DeepSeek-V3 / GLM-4.5 family (refit/archs.py); zero/False for the others
    num_shared_experts: int = 0  # one shared MLP of width moe_intermediate_size * num_shared_experts
    router_bias: bool = False  # mlp.gate.e_score_correction_bias, float32
    num_mtp_layers: int = 0  # multi-token-prediction layers after the decoder: not moved
    q_lora_rank: int = 0  # MLA (kv_lora_rank > 0); q_lora_rank 0: a plain q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # "" or a format of `refit.quantization` (an engine serving FP8): the decoder's linear weights
    # are held quantized, each with a scale tensor (`quantize_spec`)
    quantization: str = ""
    # an adapter-only refit (`refit.adapters`): the spec holds one LoRA adapter of this model, of
    # rank lora_rank on the comma-joined lora_targets (q_proj,...,down_proj), scaled by lora_scaling
    lora_rank: int = 0
    lora_targets: str = ""
    lora_scaling: float = 0.0
    # a speculative drafter trained beside the policy (refit/drafters.py): "mtp" (the MTP layers of
    # this config's model) or "eagle" (an EAGLE head of this config); "" for the model itself
    drafter: str = ""

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and len(self.moe_layers) > 0

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.moe_layers)
        return tuple(l for l in range(self.num_layers) if l not in moe)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Read an HF ``config.json`` dict; refuse architectures refit does not know."""
        arch = cfg.get("model_type", "")
        if arch not in SUPPORTED_ARCHS:
            archs = cfg.get("architectures") or []
            raise InvalidInput(
                f"unsupported model_type {arch!r} (architectures {archs}); "
                f"refit knows {', '.join(SUPPORTED_ARCHS)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise InvalidInput(f"config.json lacks {e.args[0]!r}") from None
        unstated = [k for k in MUST_STATE[arch] if not any(a in cfg for a in k.split("|"))]
        if unstated:
            names = ", ".join(" or ".join(map(repr, k.split("|"))) for k in unstated)
            raise InvalidInput(f"config.json (model_type {arch!r}) lacks {names}: refit does "
                             f"not guess them (transformers, and so vLLM, would take its config class's defaults, "
                             f"the full-size model's values); write them out")
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        experts, moe_inter, moe_layers = 0, 0, ()
        if arch == "qwen3_moe":
            # transformers 5 writes num_local_experts; earlier releases num_experts
            experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
            moe_inter = int(cfg.get("moe_intermediate_size", 0))
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            only_mlp = set(cfg.get("mlp_only_layers") or [])
            # The rule of transformers' Qwen3MoeDecoderLayer: which layers get a sparse block.
            moe_layers = tuple(
                l for l in range(layers) if l not in only_mlp and experts > 0 and (l + 1) % step == 0
            )
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        if dtype not in DTYPE_BYTES:
            raise InvalidInput(f"unsupported dtype {dtype!r}; refit knows {', '.join(DTYPE_BYTES)}")
        quantization = from_hf_config(cfg["quantization_config"]) if cfg.get("quantization_config") else ""
        if arch in FAMILY_ARCHS:
            fields = dict(arch=arch, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                          head_dim=head_dim, intermediate_size=int(cfg.get("intermediate_size", 0)),
                          vocab_size=vocab, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                          dtype=dtype, quantization=quantization)
            fields.update(family_fields(cfg, layers, heads))
            return cls(**fields)
        return cls(
            arch=arch,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            intermediate_size=int(cfg.get("intermediate_size", 0)),
            vocab_size=vocab,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            num_experts=experts,
            moe_intermediate_size=moe_inter,
            moe_layers=moe_layers,
            dtype=dtype,
            quantization=quantization,
        )


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

    if cfg.lora_rank:  # one LoRA adapter of the model, nothing of the base (refit/adapters.py)
        if cfg.quantization:
            raise InvalidInput(f"adapter of {name}: LoRA adapters are moved unquantized")
        adapter_tensors(cfg, per_layer)
        return ModelSpec(name, cfg, tuple(out))
    if cfg.drafter:  # MTP layers or an EAGLE head alone (refit/drafters.py)
        from refit.drafters import drafter_tensors

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
