"""refit's vLLM layout against the real vLLM (CPU build 0.32).

Tiny Qwen3-MoE, Qwen2 and DeepSeek-V3 (MLA, with and without q LoRA) checkpoints are loaded by a real vLLM engine at tensor-parallel
size 2 (with and without expert parallel).  Each worker's parameters are captured as vLLM's own
weight loaders left them, before `process_weights_after_loading` repacks them for CPU kernels
(tests/harness/vllm_capture/capture.py).  `refit reshard --src hf --dst vllm:tp2…` must produce exactly
those tensors: the same names, shapes and dtypes, and the same bits in every element (padding
rows included: vLLM zeroes them, refit writes zeros).  One exception, GLM-4.5's router weight:
vLLM's loader upcasts it to float32, refit's layout keeps the checkpoint's bf16 (the vLLM
backend's landing widens it): compared after that exact upcast.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from safetensors.torch import load_file

from refit.cli import main

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed"),
]

CASES = [  # (model maker, refit destination layout, vLLM enable_expert_parallel)
    ("make_tiny_qwen3_moe", "vllm:tp2", False),
    ("make_tiny_qwen3_moe", "vllm:tp2ep2", True),
    ("make_tiny_qwen2", "vllm:tp2", False),
    # DeepSeek-V3 MLA with q LoRA (fused_qkv_a_proj), shared experts, float32 router bias, expert parallel
    ("make_tiny_deepseek_v3", "vllm:tp2ep2", True),
    # Moonlight-style MLA without q LoRA (q_proj), experts tensor-split
    ("make_tiny_moonlight", "vllm:tp2", False),
    # GLM-4.5: qkv bias, partial rotary, shared expert, float32 router (upcast by vLLM's loader)
    ("make_tiny_glm4_moe", "vllm:tp2", False),
]
WIDENED = ("mlp.gate.weight",)  # GLM-4.5's router: bf16 in refit's layout, float32 in vLLM


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.harness.vllm_capture import make_models

    out = {}
    for maker in {m for m, _, _ in CASES}:
        d = str(tmp_path_factory.mktemp(maker))
        getattr(make_models, maker)(d, seed=1)
        out[maker] = d
    return out


@pytest.mark.parametrize("maker,layout,ep", CASES, ids=[f"{m[10:]}-{l}" for m, l, _ in CASES])
def test_reshard_output_equals_what_vllm_loads(tmp_path, checkpoints, maker, layout, ep):
    from refit.layouts import resolve_layout
    from refit.hf_checkpoint import load_spec
    from tests.harness.vllm_capture.capture import capture_vllm_loaded_params, read_capture_meta

    model_dir = checkpoints[maker]
    captured = capture_vllm_loaded_params(model_dir, str(tmp_path / "vllm"), 2, ep)
    out = str(tmp_path / "refit")
    assert main(["reshard", "--model", model_dir, "--src", "hf", "--dst", layout, "--in", model_dir, "--out", out]) == 0
    spec = load_spec(model_dir)
    dst = resolve_layout(layout, spec, "dst")
    for rank, path in enumerate(captured):
        want = load_file(path)
        got = load_file(os.path.join(out, f"rank-{rank:05d}.safetensors"))
        assert set(got) == set(want), f"rank {rank}: {sorted(set(got) ^ set(want))[:4]}"
        # refit lists a rank's tensors in vLLM's named_parameters() order
        assert [t.name for t in dst.local_tensors(spec, rank)] == read_capture_meta(path)["param_names"]
        for name, w in want.items():
            g = got[name]
            if spec.config.arch == "glm4_moe" and name.endswith(WIDENED):
                assert (g.dtype, w.dtype) == (torch.bfloat16, torch.float32), (rank, name, g.dtype, w.dtype)
                g = g.to(torch.float32)  # exact
            assert (g.shape, g.dtype) == (w.shape, w.dtype), (rank, name, g.shape, w.shape)
            bits = torch.int32 if w.dtype == torch.float32 else torch.int16  # router biases are float32
            assert torch.equal(g.view(bits), w.view(bits)), f"rank {rank}: {name} differs"
