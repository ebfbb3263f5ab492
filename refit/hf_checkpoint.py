"""Hugging Face checkpoints on disk: safetensors headers, ``config.json``, and the model spec
they describe.  Only headers and JSON are read here, never tensor data, and nothing imports
torch: `load_spec` is part of planning.

(`refit.layouts.hf` is a different thing: the *layout* of an HF checkpoint, one rank holding
every tensor in full.)
"""

from __future__ import annotations

import json
import os
import re
import struct
from typing import Any

from refit.catalog import CATALOG
from refit.dtypes import FROM_SAFETENSORS
from refit.errors import RefitError
from refit.spec import ModelConfig, ModelSpec, build_spec, check_tensor_table

# HF config.json ``model_type`` -> the ``architectures`` entry transformers expects (written into
# the config.json of an HF output when the input had none).  Keys: `refit.spec.SUPPORTED_ARCHS`.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own limit on a header

# HF checkpoint tensor name -> (shape, dtype, file)
CheckpointTensors = dict[str, tuple[tuple[int, ...], str, str]]


def read_safetensors_header(path: str) -> dict[str, dict[str, Any]]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} from a .safetensors file's header only."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise RefitError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise RefitError(f"{path}: not a safetensors file (header of {n} bytes)")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def checkpoint_tensors(directory: str) -> CheckpointTensors:
    """HF checkpoint tensor name -> (shape, dtype, file) for every *.safetensors in ``directory``."""
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    found: CheckpointTensors = {}
    for fname in files:
        path = os.path.join(directory, fname)
        for name, info in read_safetensors_header(path).items():
            dtype = FROM_SAFETENSORS.get(info["dtype"], info["dtype"])
            found[name] = (tuple(info["shape"]), dtype, path)
    return found


def config_from_headers(tensors: CheckpointTensors) -> dict[str, Any]:
    """Guess an HF config from tensor names and shapes (when a checkpoint has no config.json)."""
    def shape(name: str) -> tuple[int, ...]:
        if name not in tensors:
            raise RefitError(f"checkpoint has no config.json and no {name!r} to infer it from")
        return tensors[name][0]

    vocab, hidden = shape("model.embed_tokens.weight")
    layers = 1 + max(int(m.group(1)) for n in tensors if (m := re.match(r"model\.layers\.(\d+)\.", n)))
    q_rows = shape("model.layers.0.self_attn.q_proj.weight")[0]
    kv_rows = shape("model.layers.0.self_attn.k_proj.weight")[0]
    if "model.layers.0.self_attn.q_norm.weight" not in tensors:
        raise RefitError("checkpoint has no config.json; without q_norm the head size cannot be inferred")
    head_dim = shape("model.layers.0.self_attn.q_norm.weight")[0]
    cfg: dict[str, Any] = {
        "hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": layers, "head_dim": head_dim,
        "num_attention_heads": q_rows // head_dim, "num_key_value_heads": kv_rows // head_dim,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "torch_dtype": tensors["model.embed_tokens.weight"][1],
    }
    experts = {int(m.group(1)) for n in tensors if (m := re.match(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.", n))}
    if experts:
        moe = sorted({int(m.group(1)) for n in tensors if (m := re.match(r"model\.layers\.(\d+)\.mlp\.experts\.", n))})
        cfg.update(model_type="qwen3_moe", num_experts=len(experts),
                   moe_intermediate_size=shape(f"model.layers.{moe[0]}.mlp.experts.0.gate_proj.weight")[0],
                   mlp_only_layers=[l for l in range(layers) if l not in moe])
        dense = [l for l in range(layers) if l not in moe]
        if dense:
            cfg["intermediate_size"] = shape(f"model.layers.{dense[0]}.mlp.gate_proj.weight")[0]
    else:
        cfg.update(model_type="qwen3", intermediate_size=shape("model.layers.0.mlp.gate_proj.weight")[0])
    return cfg


def check_checkpoint(spec: ModelSpec, tensors: CheckpointTensors, where: str) -> None:
    """Refuse a checkpoint whose tensors differ from the spec: name the first difference."""
    expected = {t.name: (t.shape, spec[t.tensor].dtype) for t in spec.hf_tensors()}
    check_tensor_table({n: (shape, dtype) for n, (shape, dtype, _) in tensors.items()}, expected, where)


def spec_from_dir(directory: str) -> ModelSpec:
    """Spec of the model in ``directory``: from its config.json, checked against (or, without one,
    inferred from) the safetensors headers.  No tensor data is read."""
    cfg_path = os.path.join(directory, "config.json")
    tensors = checkpoint_tensors(directory)
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            hf_cfg = json.load(f)
    elif tensors:
        hf_cfg = config_from_headers(tensors)
    else:
        raise RefitError(f"{directory}: neither config.json nor *.safetensors found")
    if tensors and "torch_dtype" not in hf_cfg and "dtype" not in hf_cfg:
        hf_cfg["torch_dtype"] = next(iter(tensors.values()))[1]
    spec = build_spec(os.path.basename(os.path.normpath(directory)), ModelConfig.from_hf(hf_cfg))
    if tensors:
        check_checkpoint(spec, tensors, directory)
    return spec


def load_spec(model: str) -> ModelSpec:
    """A catalog name (``qwen3-30b-moe``) or a directory with config.json and/or safetensors."""
    if model in CATALOG:
        return build_spec(model, ModelConfig.from_hf(CATALOG[model]))
    if os.path.isdir(model):
        return spec_from_dir(model)
    raise RefitError(f"unknown model {model!r}: not a directory, and not one of {', '.join(CATALOG)}")


def hf_config(model: str, spec: ModelSpec) -> dict[str, Any]:
    """config.json for an HF output of ``model``: the input directory's own, else the catalog
    entry's, with the ``architectures`` transformers needs to load it."""
    path = os.path.join(model, "config.json")
    if os.path.isdir(model) and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    cfg = dict(CATALOG.get(model, {}))
    cfg.setdefault("architectures", [HF_ARCHITECTURES[spec.config.arch]])
    return cfg
