"""Unit tests of refit.hf_checkpoint: reading HF checkpoints (headers and config.json only)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from refit.catalog import CATALOG
from refit.errors import RefitError
from refit.hf_checkpoint import (HF_ARCHITECTURES, check_checkpoint, checkpoint_tensors, config_from_headers,
                                 hf_config, load_spec, read_safetensors_header, spec_from_dir)
from refit.spec import SUPPORTED_ARCHS, ModelConfig, build_spec
from tests.harness.tiny import TINY_CONFIGS, tiny_spec, write_hf_checkpoint


def write_with_library(directory: str, spec, dtype=torch.bfloat16, seed: int = 1) -> None:
    """An HF checkpoint of ``spec`` written by the safetensors library (not by refit), random values."""
    gen = torch.Generator().manual_seed(seed)
    os.makedirs(directory, exist_ok=True)
    save_file({t.name: torch.randn(t.shape, generator=gen).to(dtype) for t in spec.hf_tensors()},
              os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


def test_header_agrees_with_the_safetensors_library(tmp_path):
    spec = tiny_spec("tiny-qwen3-moe")
    write_with_library(str(tmp_path), spec)
    path = str(tmp_path / "model.safetensors")
    header = read_safetensors_header(path)
    assert "__metadata__" not in header
    with safe_open(path, framework="pt") as f:
        assert set(f.keys()) == set(header)
        for name in f.keys():
            assert list(f.get_slice(name).get_shape()) == header[name]["shape"]
            assert header[name]["dtype"] == "BF16"
    found = checkpoint_tensors(str(tmp_path))
    assert found["model.layers.2.mlp.experts.5.up_proj.weight"] == ((16, 32), "bfloat16", path)
    assert len(found) == len(list(spec.hf_tensors()))


def test_tensors_are_found_across_files(tmp_path):
    spec = write_hf_checkpoint(str(tmp_path), "tiny-llama", files=3)
    found = checkpoint_tensors(str(tmp_path))
    assert len({path for _, _, path in found.values()}) == 3
    check_checkpoint(spec, found, str(tmp_path))


def test_spec_inferred_from_headers_equals_the_configured_one(tmp_path):
    name = "tiny-qwen3-moe"
    write_hf_checkpoint(str(tmp_path), name)
    with_config = spec_from_dir(str(tmp_path))
    os.remove(tmp_path / "config.json")
    assert spec_from_dir(str(tmp_path)).digest() == with_config.digest() == tiny_spec(name).digest()


def test_dense_qwen3_inferred_from_headers(tmp_path):
    cfg = {"model_type": "qwen3", "hidden_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 24, "vocab_size": 50,
           "tie_word_embeddings": True, "torch_dtype": "float16"}
    spec = build_spec("d", ModelConfig.from_hf(cfg))
    write_with_library(str(tmp_path), spec, torch.float16)
    inferred = config_from_headers(checkpoint_tensors(str(tmp_path)))
    assert ModelConfig.from_hf(inferred) == ModelConfig.from_hf(cfg)


def test_dtype_comes_from_the_tensors_when_config_json_has_none(tmp_path):
    cfg = {k: v for k, v in TINY_CONFIGS["tiny-qwen2"].items() if k != "torch_dtype"}
    spec = build_spec("x", ModelConfig.from_hf({**cfg, "torch_dtype": "float32"}))
    write_with_library(str(tmp_path), spec, torch.float32)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    assert spec_from_dir(str(tmp_path)).config.dtype == "float32"


def test_dtype_from_the_tensors_is_the_embeddings_not_a_float32_router_bias(tmp_path):
    """The safetensors library writes float32 tensors before bfloat16 ones: the first tensor of a
    GLM-4.5 / DeepSeek-V3 file is its float32 e_score_correction_bias, not the model's dtype."""
    cfg = {k: v for k, v in TINY_CONFIGS["tiny-glm4-moe"].items() if k != "torch_dtype"}
    spec = build_spec("x", ModelConfig.from_hf({**cfg, "torch_dtype": "bfloat16"}))
    gen = torch.Generator().manual_seed(2)
    save_file({t.name: torch.randn(t.shape, generator=gen).to(getattr(torch, spec[t.tensor].dtype))
               for t in spec.hf_tensors()}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    assert next(iter(read_safetensors_header(str(tmp_path / "model.safetensors")).values()))["dtype"] == "F32"
    got = spec_from_dir(str(tmp_path))
    assert got.config.dtype == "bfloat16" and got.digest() == spec.digest()


def test_bad_checkpoints_are_refused_with_what_is_wrong(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"abc")
    with pytest.raises(RefitError, match="too short"):
        read_safetensors_header(str(tmp_path / "short.safetensors"))
    (tmp_path / "short.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(RefitError, match=f"header of {2**40} bytes"):
        read_safetensors_header(str(tmp_path / "short.safetensors"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RefitError, match="neither config.json nor"):
        spec_from_dir(str(empty))
    llama = tmp_path / "llama"
    write_hf_checkpoint(str(llama), "tiny-llama")
    os.remove(llama / "config.json")
    with pytest.raises(RefitError, match="without q_norm the head size cannot be inferred"):
        spec_from_dir(str(llama))


def test_a_checkpoint_that_differs_from_its_config_is_refused(tmp_path):
    write_hf_checkpoint(str(tmp_path), "tiny-qwen2")
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**TINY_CONFIGS["tiny-qwen2"], "intermediate_size": 32}, f)
    with pytest.raises(RefitError) as e:
        spec_from_dir(str(tmp_path))
    assert "'model.layers.0.mlp.gate_proj.weight' has shape [64, 32], expected [32, 32]" in str(e.value)


def test_load_spec_knows_the_catalog_and_directories(tmp_path):
    assert load_spec("qwen3-8b").name == "qwen3-8b"
    write_hf_checkpoint(str(tmp_path / "m"), "tiny-qwen2")
    assert load_spec(str(tmp_path / "m")).name == "m"
    with pytest.raises(RefitError) as e:
        load_spec("qwen9-1t")
    assert str(e.value) == f"unknown model 'qwen9-1t': not a directory, and not one of {', '.join(CATALOG)}"


def _transformers_causal_lm_names() -> dict[str, str]:
    """transformers' own model_type -> causal-LM class map, read from its source (importing
    transformers takes ~10 s)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("transformers is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "models", "auto", "modeling_auto.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES":
            return dict(ast.literal_eval(node.value.args[0]))
    raise AssertionError("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES not found")


def test_architectures_are_transformers_own_names():
    assert set(HF_ARCHITECTURES) == set(SUPPORTED_ARCHS)
    names = _transformers_causal_lm_names()
    for model_type, arch in HF_ARCHITECTURES.items():
        # kimi_k2 is remote code, not in transformers: its config names DeepSeek-V3's class
        assert names["deepseek_v3" if model_type == "kimi_k2" else model_type] == arch


def test_hf_config_for_an_output(tmp_path):
    cfg = hf_config("qwen3-30b-moe", load_spec("qwen3-30b-moe"))
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts"] == 128
    assert "architectures" not in CATALOG["qwen3-30b-moe"]  # the catalog entry is not modified
    write_hf_checkpoint(str(tmp_path), "tiny-qwen2")
    assert hf_config(str(tmp_path), tiny_spec("tiny-qwen2")) == TINY_CONFIGS["tiny-qwen2"]


def _hand_written(path: str, header: dict, data_bytes: int) -> None:
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + b"\0" * data_bytes)


F32x2 = {"dtype": "F32", "shape": [2]}


@pytest.mark.parametrize("header,data_bytes", [
    ({"a": {**F32x2, "data_offsets": [0, 8]}, "b": {**F32x2, "data_offsets": [8, 16]}}, 16),
    ({"b": {**F32x2, "data_offsets": [8, 16]}, "a": {**F32x2, "data_offsets": [0, 8]}}, 16),  # listed out of order
    ({"e": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "a": {**F32x2, "data_offsets": [0, 8]}}, 8),
    ({"__metadata__": None, "a": {**F32x2, "data_offsets": [0, 8]}}, 8),
    ({"a": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}, 8),
    ({"a": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, 2),
    ({}, 0),
    # refused by the library: overlapping, the same range twice, a gap, not starting at 0, bytes
    # not matching shape x dtype, trailing bytes, an unknown dtype, odd F4, metadata not strings
    ({"a": {**F32x2, "data_offsets": [0, 8]}, "b": {**F32x2, "data_offsets": [4, 12]}}, 16),
    ({"a": {**F32x2, "data_offsets": [0, 8]}, "b": {**F32x2, "data_offsets": [0, 8]}}, 8),
    ({"a": {**F32x2, "data_offsets": [0, 8]}, "b": {**F32x2, "data_offsets": [12, 20]}}, 20),
    ({"a": {**F32x2, "data_offsets": [4, 12]}}, 12),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8),
    ({"a": {**F32x2, "data_offsets": [0, 8]}}, 12),
    ({"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, 8),
    ({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, 2),
    ({"__metadata__": {"x": 1}, "a": {**F32x2, "data_offsets": [0, 8]}}, 8),
], ids=["packed", "listed_out_of_order", "empty_tensor", "null_metadata", "i64", "f4", "no_tensors", "overlap",
        "same_range", "gap", "not_from_0", "size", "trailing", "unknown_dtype", "odd_f4", "metadata_not_strings"])
def test_header_check_refuses_what_the_library_refuses(tmp_path, header, data_bytes):
    """Byte ranges the library refuses made `refit reshard` fail half-way with a SafetensorError
    traceback: the header check refuses exactly those, before anything is read."""
    from safetensors import SafetensorError

    path = str(tmp_path / "x.safetensors")
    _hand_written(path, header, data_bytes)
    try:
        with safe_open(path, framework="pt"):  # the library checks the header when it opens a file
            library_ok = True
    except SafetensorError:
        library_ok = False
    if library_ok:
        assert set(read_safetensors_header(path)) == set(header) - {"__metadata__"}
    else:
        with pytest.raises(RefitError, match=r"x\.safetensors"):
            read_safetensors_header(path)
