"""Smoke test of the vLLM ground-truth harness (tests/harness/vllm_capture).

Builds the two tiny checkpoints, runs real vLLM (CPU) engines at tp=2 and
checks that every rank file exists, has exactly the parameter names/shapes of
tests/harness/vllm_capture/FACTS.md, and that the values equal an independent
re-slicing of the HF checkpoint following those facts (so FACTS.md is
verified, not just asserted).

The checkpoints are test_vllm_conventions.py's (the same makers and seed), so within one run
the tp=2 captures without expert parallel are that module's engines' (`capture_vllm_loaded_params`
starts one engine per checkpoint content and settings in a run, tests/harness/run_cache.py): run
together, only the expert-parallel case starts an engine here (~35 s on 2 CPU cores); alone, 3.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

import pytest
import torch

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from tests.harness.vllm_capture.capture import capture_vllm_loaded_params, read_capture_meta  # noqa: E402
from tests.harness.vllm_capture.make_models import make_tiny_qwen2, make_tiny_qwen3_moe  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed"),
]

TP = 2


def _load(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def _vocab_shard(w: torch.Tensor, rank: int, tp: int, pad_to: int = 64) -> torch.Tensor:
    """FACTS (b): pad vocab to a multiple of 64, split evenly, pad rows are 0."""
    v = w.shape[0]
    padded = (v + pad_to - 1) // pad_to * pad_to
    per = padded // tp
    out = torch.zeros(per, *w.shape[1:], dtype=w.dtype)
    lo, hi = rank * per, min((rank + 1) * per, v)
    if hi > lo:
        out[: hi - lo] = w[lo:hi]
    return out


def _rows(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = w.shape[0] // tp
    return w[rank * n:(rank + 1) * n]


def _cols(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = w.shape[1] // tp
    return w[:, rank * n:(rank + 1) * n]


def _qkv(q, k, v, rank, tp, n_kv_heads):
    """FACTS (c): [q_r; k_r'; v_r'] with r' = rank // max(1, tp // n_kv_heads)."""
    replicas = max(1, tp // n_kv_heads)
    kv_tp = tp // replicas
    return torch.cat([_rows(q, rank, tp), _rows(k, rank // replicas, kv_tp),
                      _rows(v, rank // replicas, kv_tp)], 0)


def expected_rank(hf: dict, cfg: dict, rank: int, tp: int, ep: bool) -> dict[str, torch.Tensor]:
    """Independent re-implementation of vLLM 0.32's per-rank layout (FACTS.md)."""
    out: dict[str, torch.Tensor] = {}
    nkv = cfg["num_key_value_heads"]
    out["model.embed_tokens.weight"] = _vocab_shard(hf["model.embed_tokens.weight"], rank, tp)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = _vocab_shard(hf["lm_head.weight"], rank, tp)
    out["model.norm.weight"] = hf["model.norm.weight"]
    moe = "num_local_experts" in cfg or "num_experts" in cfg
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{n}.weight"] = hf[f"{p}.{n}.weight"]
        out[f"{a}.qkv_proj.weight"] = _qkv(hf[f"{a}.q_proj.weight"], hf[f"{a}.k_proj.weight"],
                                           hf[f"{a}.v_proj.weight"], rank, tp, nkv)
        if f"{a}.q_proj.bias" in hf:
            out[f"{a}.qkv_proj.bias"] = _qkv(hf[f"{a}.q_proj.bias"], hf[f"{a}.k_proj.bias"],
                                             hf[f"{a}.v_proj.bias"], rank, tp, nkv)
        out[f"{a}.o_proj.weight"] = _cols(hf[f"{a}.o_proj.weight"], rank, tp)
        for n in ("q_norm", "k_norm"):
            if f"{a}.{n}.weight" in hf:
                out[f"{a}.{n}.weight"] = hf[f"{a}.{n}.weight"]
        m = f"{p}.mlp"
        if moe:
            E = cfg.get("num_local_experts", cfg.get("num_experts"))
            out[f"{m}.gate.weight"] = hf[f"{m}.gate.weight"]
            if ep:  # FACTS (d): linear placement, whole experts, no TP split
                base, rem = divmod(E, tp)
                n_local = base + (1 if rank < rem else 0)
                start = rank * base + min(rank, rem)
                gids, mtp, mrank = range(start, start + n_local), 1, 0
            else:  # experts TP-sharded on the intermediate dim
                gids, mtp, mrank = range(E), tp, rank
            w13, w2 = [], []
            for e in gids:
                x = f"{m}.experts.{e}"
                w13.append(torch.cat([_rows(hf[f"{x}.gate_proj.weight"], mrank, mtp),
                                      _rows(hf[f"{x}.up_proj.weight"], mrank, mtp)], 0))
                w2.append(_cols(hf[f"{x}.down_proj.weight"], mrank, mtp))
            out[f"{m}.experts.routed_experts.w13_weight"] = torch.stack(w13)
            out[f"{m}.experts.routed_experts.w2_weight"] = torch.stack(w2)
        else:
            out[f"{m}.gate_up_proj.weight"] = torch.cat(
                [_rows(hf[f"{m}.gate_proj.weight"], rank, tp), _rows(hf[f"{m}.up_proj.weight"], rank, tp)], 0)
            out[f"{m}.down_proj.weight"] = _cols(hf[f"{m}.down_proj.weight"], rank, tp)
    return out


# Shapes from FACTS.md (a), independent of the re-slicing above.
QWEN3_MOE_SHAPES = {
    "lm_head.weight": (512, 128),
    "model.embed_tokens.weight": (512, 128),
    "model.norm.weight": (128,),
    "model.layers.{i}.input_layernorm.weight": (128,),
    "model.layers.{i}.post_attention_layernorm.weight": (128,),
    "model.layers.{i}.self_attn.qkv_proj.weight": (256, 128),
    "model.layers.{i}.self_attn.o_proj.weight": (128, 128),
    "model.layers.{i}.self_attn.q_norm.weight": (64,),
    "model.layers.{i}.self_attn.k_norm.weight": (64,),
    "model.layers.{i}.mlp.gate.weight": (4, 128),
    "model.layers.{i}.mlp.experts.routed_experts.w13_weight": (4, 64, 128),
    "model.layers.{i}.mlp.experts.routed_experts.w2_weight": (4, 128, 32),
}
QWEN3_MOE_EP_SHAPES = dict(QWEN3_MOE_SHAPES, **{
    "model.layers.{i}.mlp.experts.routed_experts.w13_weight": (2, 128, 128),
    "model.layers.{i}.mlp.experts.routed_experts.w2_weight": (2, 128, 64),
})
QWEN2_SHAPES = {  # tied: no lm_head.weight in named_parameters()
    "model.embed_tokens.weight": (512, 256),
    "model.norm.weight": (256,),
    "model.layers.{i}.input_layernorm.weight": (256,),
    "model.layers.{i}.post_attention_layernorm.weight": (256,),
    "model.layers.{i}.self_attn.qkv_proj.weight": (256, 256),
    "model.layers.{i}.self_attn.qkv_proj.bias": (256,),
    "model.layers.{i}.self_attn.o_proj.weight": (256, 128),
    "model.layers.{i}.mlp.gate_up_proj.weight": (256, 256),
    "model.layers.{i}.mlp.down_proj.weight": (256, 128),
}


def _expand(shapes: dict) -> dict:
    out = {}
    for k, v in shapes.items():
        for i in (range(2) if "{i}" in k else [None]):
            out[k.format(i=i)] = v
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_harness")
    q3, q2 = str(root / "qwen3_moe"), str(root / "qwen2")
    # seed 1, as test_vllm_conventions.py's checkpoints: the same content, so its captures serve here
    make_tiny_qwen3_moe(q3, seed=1)
    make_tiny_qwen2(q2, seed=1)
    return root, q3, q2


def _check(model_dir, files, shapes, ep):
    import json

    assert [os.path.basename(f) for f in files] == [f"rank-{r:05d}.safetensors" for r in range(TP)]
    hf = _load(os.path.join(model_dir, "model.safetensors"))
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    shapes = _expand(shapes)
    for r, path in enumerate(files):
        assert os.path.getsize(path) > 0
        got = _load(path)
        meta = read_capture_meta(path)
        assert meta["tp_rank"] == r and meta["tp_size"] == TP
        # capture cleans this engine's (sometimes leaked) CPU shm segments
        assert meta["vllm_dist_ident"] and not glob.glob(f"/dev/shm/{glob.escape(meta['vllm_dist_ident'])}-*")
        assert {k: tuple(v.shape) for k, v in got.items()} == shapes, f"rank {r}"
        assert all(v.dtype == torch.bfloat16 for v in got.values())
        exp = expected_rank(hf, cfg, r, TP, ep)
        assert set(exp) == set(got)
        for k in exp:
            assert torch.equal(got[k], exp[k]), f"rank {r}: {k} differs from FACTS.md layout"
        # Vocab padding rows are zero (only on the last rank for V=1000, tp=2).
        emb = got["model.embed_tokens.weight"]
        n_real = min(1000 - r * 512, 512)
        assert torch.count_nonzero(emb[n_real:]) == 0 and torch.all(emb[:n_real].abs().sum(1) > 0)
    return meta


def test_qwen3_moe_tp2(models, tmp_path):
    _, q3, _ = models
    files = capture_vllm_loaded_params(q3, str(tmp_path / "cap"), tensor_parallel_size=TP)
    meta = _check(q3, files, QWEN3_MOE_SHAPES, ep=False)
    for layer in meta["moe"].values():
        assert layer["moe_use_ep"] is False and layer["moe_tp_size"] == TP
        assert layer["local_to_global"] == [0, 1, 2, 3]


def test_qwen3_moe_tp2_ep(models, tmp_path):
    _, q3, _ = models
    files = capture_vllm_loaded_params(q3, str(tmp_path / "cap"), tensor_parallel_size=TP,
                                       enable_expert_parallel=True)
    _check(q3, files, QWEN3_MOE_EP_SHAPES, ep=True)
    for r, f in enumerate(files):
        for layer in read_capture_meta(f)["moe"].values():
            assert layer["moe_use_ep"] is True and layer["moe_ep_size"] == TP
            assert layer["moe_tp_size"] == 1 and layer["moe_ep_rank"] == r
            assert layer["local_to_global"] == [2 * r, 2 * r + 1]


def test_qwen2_tp2(models, tmp_path):
    _, _, q2 = models
    files = capture_vllm_loaded_params(q2, str(tmp_path / "cap"), tensor_parallel_size=TP)
    _check(q2, files, QWEN2_SHAPES, ep=False)
