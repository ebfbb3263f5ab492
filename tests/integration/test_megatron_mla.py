"""refit's Megatron MLA mapping against megatron-core 0.16.1 run on CPU (tests/harness/megatron_mla_check.py).

* Megatron's MLASelfAttention, loaded with an HF DeepSeek-V3 attention's weights under refit's name
  mapping and no row reordering, computes the same output as transformers' DeepseekV3Attention
  (rope_interleave, DeepSeek-V3's default): no rope-dimension reordering exists between them.  The
  same check with a non-interleaved HF rope differs by O(1): the check can see a reordering.
* The parameter shapes of the local spec at tp 1 equal refit's (TE-spec) shapes; at tp 2 the local
  spec splits the down-projections over tp while the TE spec keeps them whole, and refit's ``local1``
  layout holds exactly the local spec's shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from refit.layouts import MegatronLayout
from refit.spec import ModelConfig, build_spec

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


CASES = [dict(q_lora_rank=16), dict(q_lora_rank=None), dict(q_lora_rank=16, rope_interleave=False),
         dict(q_lora_rank=16, tp=2, rank=1)]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    """All checks in one subprocess (importing megatron-core and transformers costs most of the time)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "tests.harness.megatron_mla_check", json.dumps(CASES)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    line = next((x for x in out.stdout.splitlines() if x.startswith("REFIT_MLA_RESULT ")), None)
    assert line, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(line.split(" ", 1)[1])


# TE-spec name refit uses -> local-spec name megatron_mla_check builds
TE_TO_LOCAL = {"linear_q_up_proj.layer_norm_weight": "q_layernorm.weight",
               "linear_kv_up_proj.layer_norm_weight": "kv_layernorm.weight"}


def refit_attention_shapes(q_lora_rank: int, tp: int, rank: int, local: int = 0) -> dict[str, list[int]]:
    cfg = ModelConfig("deepseek_v3", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=4, head_dim=12,
                      intermediate_size=16, vocab_size=64, q_lora_rank=q_lora_rank, kv_lora_rank=16,
                      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    spec = build_spec("mla", cfg)
    layout = MegatronLayout(tp=tp, local=local).resolve(spec)
    out = {}
    for t in layout.local_tensors(spec, rank):
        if ".self_attention." in t.name:
            local = t.name.split(".self_attention.", 1)[1]
            out[TE_TO_LOCAL.get(local, local)] = list(t.shape)
    return out


@pytest.mark.parametrize("case,q_lora_rank", [(0, 16), (1, None)])
def test_megatron_mla_equals_transformers_on_the_same_weights(results, case, q_lora_rank):
    r = results[case]
    assert r["max_abs_diff"] < 1e-5 * r["max_abs"], r["max_abs_diff"]  # float32 rotary tables on both sides
    assert dict((n, s) for n, s in r["params"]) == refit_attention_shapes(q_lora_rank or 0, 1, 0)


def test_the_check_would_see_a_rope_reordering(results):
    r = results[2]
    assert r["max_abs_diff"] > 0.1 * r["max_abs"]


def test_local_spec_splits_down_projections_that_the_te_spec_keeps_whole(results):
    local = dict((n, s) for n, s in results[3]["params"])
    te = refit_attention_shapes(16, 2, 1)
    for name in ("linear_q_down_proj.weight", "linear_kv_down_proj.weight"):
        assert local[name][0] * 2 == te[name][0]  # local: rows / tp; TE: whole
    for name in ("linear_q_up_proj.weight", "linear_kv_up_proj.weight", "linear_proj.weight"):
        assert local[name] == te[name]
    assert local == refit_attention_shapes(16, 2, 1, local=1)  # refit's local1 layout: every shape


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 2), (1, 2, 4)])
def test_glm_style_gptmodel_names_and_shapes(tp, pp, ep):
    """GQA with qkv bias and qk norm, a dense first layer, shared experts and the router's float32
    ``expert_bias`` buffer: GPTModel's parameters and persistent buffers (local spec, mapped to TE
    names) equal refit's local tensors rank by rank."""
    from refit.layouts.base import pad_to
    from refit.layouts.megatron import VOCAB_DIVISIBLE_BY
    from tests.harness import megatron as mh

    layers, vocab = 4, 200
    cfg = ModelConfig("glm4_moe", hidden_size=16, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=4,
                      intermediate_size=32, vocab_size=vocab, qkv_bias=True, qk_norm=True, num_experts=4,
                      moe_intermediate_size=8, moe_layers=(1, 2, 3), num_shared_experts=2, router_bias=True)
    spec = build_spec("glm", cfg)
    layout = MegatronLayout(tp=tp, pp=pp, ep=ep, etp=1).resolve(spec)
    got = mh.megatron_gpt_param_names(
        num_layers=layers, hidden_size=16, num_attention_heads=4, num_query_groups=2, kv_channels=4,
        ffn_hidden_size=32, moe_ffn_hidden_size=8, num_experts=4, moe_layer_freq=[0, 1, 1, 1],
        vocab_size=pad_to(vocab, VOCAB_DIVISIBLE_BY * tp), tp=tp, pp=pp, ep=ep, etp=1, qk_layernorm=True,
        add_qkv_bias=True, moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=16,
        world_size=layout.world_size, with_sharded=False)
    for rank in range(layout.world_size):
        ours = {(t.name, t.shape) for t in layout.local_tensors(spec, rank)}
        theirs = set()
        for (r, _chunk), info in got.items():
            if r != rank:
                continue
            for name, shape in info["params"] + info["buffers"]:
                j = int(name.split(".")[2]) if name.startswith("decoder.layers.") else None
                is_moe = j is not None and info["layer_numbers"][j] in cfg.moe_layers
                theirs.add((mh.te_spec_param_name(name, is_moe_layer=is_moe), tuple(shape)))
        assert ours == theirs, f"rank {rank}: only refit {sorted(ours - theirs)[:3]}, only megatron {sorted(theirs - ours)[:3]}"
