"""Hugging Face checkpoints on disk: safetensors headers, ``config.json``, and the model spec
they describe.  Only headers and JSON are read here, never tensor data, and nothing imports
torch: `load_spec` is part of planning.

(`refit.layouts.hf` is a different thing: the *layout* of an HF checkpoint, one rank holding
every tensor in full.)
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
from typing import Any

from refit.catalog import CATALOG
from refit.drafters import is_not_moved
from refit.dtypes import FROM_SAFETENSORS
from refit.errors import InvalidInput, RefitError
from refit.spec import ModelConfig, ModelSpec, build_spec, check_tensor_table

log = logging.getLogger(__name__)

# HF config.json ``model_type`` -> the ``architectures`` entry transformers expects (written into
# the config.json of an HF output when the input had none).  Keys: `refit.spec.SUPPORTED_ARCHS`.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",  # Kimi-K2's config.json names DeepSeek-V3's class (its code is remote)
    "glm4_moe": "Glm4MoeForCausalLM",
}

MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own limit on a header

# HF checkpoint tensor name -> (shape, dtype, file)
CheckpointTensors = dict[str, tuple[tuple[int, ...], str, str]]


def read_safetensors_header(path: str) -> dict[str, dict[str, Any]]:
    """A .safetensors file's header, checked: JSON of well-formed entries whose byte ranges the
    safetensors library will accept (`check_data_offsets`), and every byte they describe present
    in the file (a truncated file is refused here, before anything is written)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise InvalidInput(f"{path}: not a safetensors file (too short: {size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise InvalidInput(f"{path}: not a safetensors file, or truncated (a header of {n} bytes in {size})")
            header = json.loads(f.read(n))
    except RefitError:  # a ValueError too: not to be re-worded below
        raise
    except OSError as e:
        raise InvalidInput(f"{path}: cannot read: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise InvalidInput(f"{path}: not a safetensors file (its header is not JSON: {str(e)[:80]})") from None
    if not isinstance(header, dict):
        raise InvalidInput(f"{path}: not a safetensors file (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None)  # null or absent: none
    if not (metadata is None or isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise InvalidInput(f"{path}: malformed header: __metadata__ must map names to strings")
    for name, info in header.items():
        ok = isinstance(info, dict) and isinstance(info.get("dtype"), str) and isinstance(info.get("shape"), list) \
            and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2 \
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                    for d in info["shape"] + info["data_offsets"]) \
            and info["data_offsets"][0] <= info["data_offsets"][1]
        if not ok:
            raise InvalidInput(f"{path}: malformed header entry for tensor {name[:80]!r}")
    check_data_offsets(header, path, size - 8 - n)
    return header


# Bits per element of every dtype code the safetensors format knows (F4, F6: packed sub-byte).
SAFETENSORS_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
                    "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
                    "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def check_data_offsets(header: dict[str, dict[str, Any]], path: str, data_bytes: int) -> None:
    """Refuse the byte ranges the safetensors library would refuse — with a `SafetensorError`
    half-way through a reshard, after files were written — naming file and tensor: each range
    exactly shape x dtype wide, the ranges back to back from byte 0 in offset order (none
    overlapping, no gap), the last ending where the file does (``data_bytes`` after the header)."""
    end, prev = 0, ""
    for name, info in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        start, stop = info["data_offsets"]
        what = f"{path}: tensor {name[:80]!r} (data_offsets [{start}, {stop}])"
        bits = SAFETENSORS_BITS.get(info["dtype"])
        if bits is None:
            raise InvalidInput(f"{what} has dtype {info['dtype'][:20]!r}, not a safetensors dtype")
        if start < end:
            raise InvalidInput(f"{what} overlaps tensor {prev[:80]!r}, which ends at {end}")
        if start > end:
            raise InvalidInput(f"{what} leaves a gap of {start - end} bytes after byte {end}")
        bits *= math.prod(info["shape"])
        if bits % 8 or bits // 8 != stop - start:
            raise InvalidInput(f"{what} holds {stop - start} bytes; {info['dtype']} {info['shape']} takes {bits / 8:g}")
        end, prev = stop, name
    if end > data_bytes:
        raise InvalidInput(f"{path}: truncated: its header describes {end} bytes of data, the file holds {data_bytes}")
    if end < data_bytes:
        raise InvalidInput(f"{path}: {data_bytes - end} bytes after the last tensor's data_offsets: not a safetensors "
                         f"file, or damaged")


def checkpoint_tensors(directory: str) -> CheckpointTensors:
    """HF tensor name -> (shape, dtype, file).  With ``model.safetensors.index.json`` its weight map
    decides which file holds what; without one, a tensor found in two files is refused (a stray
    copy must not silently win)."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    found: CheckpointTensors = {}
    headers: dict[str, dict[str, dict[str, Any]]] = {}

    def header(fname: str) -> dict[str, dict[str, Any]]:
        if fname not in headers:
            headers[fname] = read_safetensors_header(os.path.join(directory, fname))
        return headers[fname]

    def entry(name: str, fname: str) -> tuple[tuple[int, ...], str, str]:
        info = header(fname)[name]
        return tuple(info["shape"]), FROM_SAFETENSORS.get(info["dtype"], info["dtype"]), os.path.join(directory, fname)

    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            assert isinstance(weight_map, dict)
        except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
            raise InvalidInput(f"{index_path}: not an index with a weight_map ({type(e).__name__})") from None
        for name, fname in weight_map.items():
            if not isinstance(fname, str) or os.path.basename(fname) != fname or not fname.endswith(".safetensors"):
                raise InvalidInput(f"{index_path}: {name!r} maps to {str(fname)[:80]!r}, not a file of this directory")
            if not os.path.exists(os.path.join(directory, fname)):
                raise InvalidInput(f"{index_path}: {name!r} is in {fname}, which is missing")
            if name not in header(fname):
                raise InvalidInput(f"{index_path}: {name!r} is not in {fname}")
            found[name] = entry(name, fname)
        return found
    for fname in sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")):
        for name in header(fname):
            if name in found:
                raise InvalidInput(f"{directory}: {name!r} is in both {os.path.basename(found[name][2])} and {fname}; "
                                 f"remove the stray file or add model.safetensors.index.json")
            found[name] = entry(name, fname)
    return found


def config_from_headers(tensors: CheckpointTensors) -> dict[str, Any]:
    """Guess an HF config from tensor names and shapes (when a checkpoint has no config.json)."""
    def shape(name: str) -> tuple[int, ...]:
        if name not in tensors:
            raise InvalidInput(f"checkpoint has no config.json and no {name!r} to infer it from")
        return tensors[name][0]

    vocab, hidden = shape("model.embed_tokens.weight")
    layers = 1 + max(int(m.group(1)) for n in tensors if (m := re.match(r"model\.layers\.(\d+)\.", n)))
    q_rows = shape("model.layers.0.self_attn.q_proj.weight")[0]
    kv_rows = shape("model.layers.0.self_attn.k_proj.weight")[0]
    if "model.layers.0.self_attn.q_norm.weight" not in tensors:
        raise InvalidInput("checkpoint has no config.json; without q_norm the head size cannot be inferred")
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
    # MTP layers (DeepSeek-V3, GLM-4.5), and what a drafter's checkpoint holds of the target's, are
    # accepted and named as not moved, never dropped silently
    found = {n: (shape, dtype) for n, (shape, dtype, _) in tensors.items() if not is_not_moved(spec.config, n)}
    if len(found) < len(tensors):
        for line in spec.not_moved:
            log.warning("%s: %s (%d tensors)", where, line, len(tensors) - len(found))
    check_tensor_table(found, expected, where)


def spec_from_dir(directory: str) -> ModelSpec:
    """Spec of the model in ``directory``: from its config.json, checked against (or, without one,
    inferred from) the safetensors headers.  No tensor data is read."""
    cfg_path = os.path.join(directory, "config.json")
    tensors = checkpoint_tensors(directory)
    if os.path.exists(cfg_path):
        hf_cfg = _read_json(cfg_path)
    elif tensors:
        hf_cfg = config_from_headers(tensors)
    else:
        raise InvalidInput(f"{directory}: neither config.json nor *.safetensors found")
    if tensors and "torch_dtype" not in hf_cfg and "dtype" not in hf_cfg:
        # the embedding's: safetensors writes wider dtypes first, so the first tensor may be a float32 router bias
        first = tensors.get("model.embed_tokens.weight") or next(iter(tensors.values()))
        hf_cfg["torch_dtype"] = first[1]
    spec = build_spec(os.path.basename(os.path.normpath(directory)), ModelConfig.from_hf(hf_cfg))
    if tensors:
        check_checkpoint(spec, tensors, directory)
    return spec


def load_spec(model: str) -> ModelSpec:
    """A catalog name (``qwen3-30b-moe``) or a directory with config.json and/or safetensors.
    Raises `refit.InvalidInput` for an unknown name, or a directory refit cannot read a model from."""
    if model in CATALOG:
        return build_spec(model, ModelConfig.from_hf(CATALOG[model]))
    if os.path.isdir(model):
        return spec_from_dir(model)
    raise InvalidInput(f"unknown model {model!r}: not a directory, and not one of {', '.join(CATALOG)}")


def hf_config(model: str, spec: ModelSpec) -> dict[str, Any]:
    """config.json for an HF output of ``model``: the input directory's own, else the catalog
    entry's, with the ``architectures`` transformers needs to load it."""
    path = os.path.join(model, "config.json")
    if os.path.isdir(model) and os.path.exists(path):
        return _read_json(path)
    cfg = dict(CATALOG.get(model, {}))
    if "architectures" not in cfg:  # catalog entries of other families name their own
        cfg["architectures"] = [HF_ARCHITECTURES[spec.config.arch]]
    return cfg


def _read_json(path: str) -> dict[str, Any]:
    """A JSON object from ``path``; anything else is one line of `RefitError`, not a traceback."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise InvalidInput(f"{path}: cannot read it: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:
        raise InvalidInput(f"{path}: not JSON: {str(e)[:120]}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}: not a JSON object")
    return data
