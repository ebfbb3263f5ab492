"""Quantized engines: the weight formats refit writes into, and which tensors they cover.

An engine that serves FP8 holds each linear weight of the decoder as float8 values plus a scale
per block (``weight`` + ``weight_scale_inv``: the DeepSeek-V3 / Qwen3-FP8 checkpoint format and
vLLM's ``fp8`` checkpoint method with ``weight_block_size [128, 128]``).  In refit that is simply
another model spec (`refit.spec.quantize_spec`): every covered weight becomes float8 and gains a
canonical scale tensor named ``<weight>_scale_inv`` of shape ``[..., ceil(R/128), ceil(C/128)]``
over the weight's last two dims.  Plans, layouts (`refit.layouts.quantized`) and the wire then
carry float8 bytes; the trainer quantizes its own shard before sending
(`refit.executor.quantize`), so about half the bytes of a bfloat16 refit cross the wire.

Pure data: no torch here.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from refit.errors import InvalidInput


class QuantFormat(NamedTuple):
    name: str  # refit's name (``--dst-dtype``, ``ModelConfig.quantization``)
    value_dtype: str  # the weight's elements
    block: tuple[int, int]  # block over the weight's last two dims (rows, columns)
    scale_suffix: str  # the scale tensor is named ``<weight name><suffix>``
    scale_dtype: str
    partial_blocks: bool  # whether a block may end past a weight's far edge (a scale for its part)
    # the ``quantization_config`` of an HF checkpoint in this format (what vLLM reads); empty: no
    # checkpoint format checked against vLLM's loaders, so refit writes and reads none
    hf_config: dict


FORMATS: dict[str, QuantFormat] = {f.name: f for f in (
    QuantFormat("fp8", "float8_e4m3fn", (128, 128), "_scale_inv", "float32", True,
                {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": [128, 128]}),
    # OCP MXFP8: 1x32 blocks along the input dim, a power-of-two scale as its e8m0 byte (vLLM's
    # ``mxfp8`` online method holds ``weight`` float8 and ``weight_scale`` uint8 [N, K/32])
    QuantFormat("mxfp8", "float8_e4m3fn", (1, 32), "_scale", "uint8", False, {}),
)}


def quant_format(name: str) -> QuantFormat:
    fmt = FORMATS.get(name)
    if fmt is None:
        raise InvalidInput(f"unknown quantization {name!r}: refit writes {', '.join(FORMATS)} (fp8: float8 e4m3 "
                           f"with 128x128 block scales, as DeepSeek-V3 / Qwen3-FP8 checkpoints; mxfp8: 1x32 "
                           f"blocks with e8m0 scales)")
    return fmt


def is_quantized(name: str) -> bool:
    """Whether a canonical tensor is one a quantized engine holds in the quantized format: the
    linear weights of the decoder layers (attention and MLP projections, experts, shared experts).
    Embeddings, the output layer, norms, biases and the MoE router stay in the model's dtype — as
    in vLLM's FP8 checkpoints (the router is no quantized linear there, and the rest are not
    linear layers at all)."""
    return name.startswith("model.layers.*.") and (name.endswith("proj.weight") or name.endswith("_mqa.weight"))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of the block scales of a weight of ``shape`` (blocks over its last two dims; a
    partial block at a far end has a scale of its own)."""
    return tuple(shape[:-2]) + (math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def hf_quantization_config(fmt: str, moe_layers: tuple[int, ...]) -> dict:
    """The ``quantization_config`` of a checkpoint refit writes in ``fmt``.  It names every MoE
    router in ``modules_to_not_convert`` (full module names: vLLM matches them whole): without
    that, vLLM's fp8 method quantizes a Qwen3-MoE router too and casts the checkpoint's bfloat16
    router into float8 with no scale — refit, like Qwen's FP8 checkpoints, keeps routers unquantized."""
    f = quant_format(fmt)
    if not f.hf_config:
        raise InvalidInput(f"refit writes no {fmt} checkpoints yet (no checkpoint format checked against vLLM's "
                           f"loaders): write rank files of an engine layout, or fp8")
    return {**f.hf_config,
            "modules_to_not_convert": ["lm_head", *(f"model.layers.{l}.mlp.gate" for l in moe_layers)]}


# What a checkpoint may leave unquantized beyond the tensors refit never quantizes: module names
# whose weights `is_quantized` already excludes (routers, the output layer, norms, embeddings).
_UNCONVERTED_OK = ("lm_head", "mlp.gate", "layernorm", "norm", "embed_tokens")


def from_hf_config(qc: object) -> str:
    """refit's format for an HF checkpoint's ``quantization_config``; refused (naming what it
    says) unless it is one refit writes and has checked against vLLM's loaders."""
    if not isinstance(qc, dict):
        raise InvalidInput(f"quantization_config {qc!r} is not a JSON object")
    for fmt in FORMATS.values():
        want = fmt.hf_config
        if want and str(qc.get("quant_method")) == want["quant_method"] and list(qc.get("weight_block_size") or []) == \
                want["weight_block_size"] and str(qc.get("fmt", "e4m3")) == want["fmt"] \
                and str(qc.get("activation_scheme", "dynamic")) == want["activation_scheme"]:
            kept = [str(m) for m in (qc.get("modules_to_not_convert") or qc.get("ignored_layers") or [])]
            other = [m for m in kept if not m.endswith(_UNCONVERTED_OK)]
            if other:  # a linear layer left in bfloat16: refit's spec would hold it in float8
                raise InvalidInput(f"quantized checkpoint leaves {len(other)} linear modules unquantized (e.g. "
                                   f"{other[0]!r}): refit moves {fmt.name} checkpoints whose every decoder linear "
                                   f"layer but the routers is quantized")
            return fmt.name
    raise InvalidInput(f"quantized checkpoint (quantization_config {dict(qc)}): refit moves "
                       f"{', '.join(f'{f.name} {f.hf_config}' for f in FORMATS.values() if f.hf_config)} only")
