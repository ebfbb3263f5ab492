"""`ModelConfig`: the numbers that decide a model's tensors, read from an HF ``config.json``.

It lives apart from `refit.spec` (which builds a config's canonical tensors and re-exports it) so
that what describes a config beyond a plain model, `refit.adapters` (LoRA) and `refit.drafters`
(MTP layers, EAGLE heads), can name and build configs without importing the spec builder that calls
them: the model's modules then import one way, `refit.archs` -> here -> adapters / drafters ->
`refit.spec` (tests/unit/test_import_cycles.py).  Nothing here imports torch.

What a config describes beyond the model's own weights is one field each, not a set of flags:
``lora`` (a `LoraAdapter`, or None), ``quantization`` (a format name) and ``drafter`` (a drafter
kind).  The last two stay names: each picks one thing whose numbers follow from the name
(`refit.quantization`'s formats) or from the model (its MTP layers, an EAGLE head's config), so
there is nothing to compose beside them.  `LoraAdapter` is defined here, not in `refit.adapters`,
because `ModelConfig` holds one and `refit.adapters` sits above this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from refit.archs import FAMILY_ARCHS, family_fields
from refit.dtypes import DTYPE_BYTES
from refit.errors import InvalidInput
from refit.quantization import from_hf_config

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
class LoraAdapter:
    """One LoRA adapter of a model (`refit.adapters` builds its tensors and checks it): the A and B
    matrices of rank ``rank`` on each of ``targets`` on every layer.  ``targets`` are module names
    (``q_proj`` ... ``down_proj``) in `refit.adapters.TARGETS`'s order, each once; ``scaling`` is
    PEFT's (``lora_alpha / r``, rsLoRA ``lora_alpha / sqrt(r)``), one for every module."""

    rank: int
    targets: tuple[str, ...]
    scaling: float


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
    # an adapter-only refit (`refit.adapters`): the spec holds this LoRA adapter of the model and
    # nothing of the base; None for the model itself
    lora: LoraAdapter | None = None
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
    def from_fields(cls, fields: dict[str, Any]) -> "ModelConfig":
        """The config whose `dataclasses.asdict` read back from JSON is ``fields``: the inverse a
        registration needs (`refit.control.common`'s ``config_json``), where tuples arrive as lists
        and the adapter as an object.  A malformed value raises TypeError."""
        fields = dict(fields)
        fields["moe_layers"] = tuple(fields.get("moe_layers", ()))
        lora = fields.get("lora")
        if lora is not None:
            if not isinstance(lora, dict) or not isinstance(lora.get("targets"), (list, tuple)):
                raise TypeError(f"lora must be an object with a list of targets, not {lora!r}")
            fields["lora"] = LoraAdapter(**{**lora, "targets": tuple(lora["targets"])})
        return cls(**fields)

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
