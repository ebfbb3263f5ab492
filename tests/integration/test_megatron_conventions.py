"""refit's Megatron layout against megatron-core 0.16.1's own code, run on CPU
(tests/harness/megatron/: RankGenerator / initialize_model_parallel, the pipeline layer offsets,
SelfAttention's qkv split, MLP's fc1 split, GPTModel's named_parameters)."""

from __future__ import annotations

import pytest

from refit.layouts import MegatronLayout
from refit.layouts.base import pad_to
from refit.layouts.megatron import VOCAB_DIVISIBLE_BY
from refit.spec import ModelConfig, build_spec

pytest.importorskip("megatron.core")

from tests.harness import megatron as mh  # noqa: E402

pytestmark = pytest.mark.megatron


def moe_spec(layers: int = 4, heads: int = 4, kv: int = 2, experts: int = 4, vocab: int = 200):
    return build_spec("m", ModelConfig("qwen3_moe", hidden_size=16, num_layers=layers, num_heads=heads,
                                       num_kv_heads=kv, head_dim=4, intermediate_size=32, vocab_size=vocab,
                                       qk_norm=True, num_experts=experts, moe_intermediate_size=8,
                                       moe_layers=tuple(range(layers))))


@pytest.mark.parametrize("tp,pp,cp,ep,etp,dp", [
    (2, 2, 1, 2, 1, 2), (2, 1, 2, 2, 1, 2), (4, 2, 1, 8, 1, 2), (2, 1, 1, 2, 2, 2), (1, 3, 2, 4, 1, 2), (2, 2, 2, 1, 1, 1),
])
def test_rank_coordinates_match_megatron(tp, pp, cp, ep, etp, dp):
    layout = MegatronLayout(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=dp)
    want = mh.megatron_rank_coords(layout.world_size, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    assert [layout.coords(r) for r in range(layout.world_size)] == want


@pytest.mark.parametrize("layers,pp,vpp,first,last", [
    (8, 2, 2, None, None), (8, 4, 1, None, None), (7, 3, 1, 1, 2), (12, 4, 2, 2, 2), (12, 3, 2, 4, None),
    (10, 3, 1, None, 2), (9, 3, 3, None, None),
])
def test_pipeline_layers_match_megatron(layers, pp, vpp, first, last):
    layout = MegatronLayout(pp=pp, vpp=vpp, first=first, last=last)
    want = mh.megatron_layer_ids(layers, pp=pp, vpp=vpp if vpp > 1 else None, first=first, last=last)
    assert layout.stage_layers(layers) == want


@pytest.mark.parametrize("layers,pp,vpp,first,last", [(12, 3, 2, 2, None), (9, 2, 1, None, None), (8, 3, 2, 3, 3)])
def test_pipeline_splits_megatron_refuses_are_refused(layers, pp, vpp, first, last):
    from refit.errors import RefitError

    with pytest.raises((ValueError, AssertionError, ZeroDivisionError)):
        mh.megatron_layer_ids(layers, pp=pp, vpp=vpp if vpp > 1 else None, first=first, last=last)
    with pytest.raises(RefitError):
        MegatronLayout(pp=pp, vpp=vpp, first=first, last=last).stage_layers(layers)


@pytest.mark.parametrize("layers,pp", [(94, 4), (6, 2), (46, 4)])
def test_uneven_default_matches_megatrons_embedding_and_loss_accounting(layers, pp):
    layout = MegatronLayout(pp=pp).resolve(moe_spec(layers=layers))
    want = mh.megatron_layer_ids(layers, pp=pp, vpp=None, account_for_embedding=True, account_for_loss=True)
    assert layout.stage_layers(layers) == want


@pytest.mark.parametrize("heads,kv,tp", [(4, 2, 2), (8, 2, 4), (8, 8, 2), (8, 2, 8), (8, 1, 4), (6, 3, 3), (4, 1, 2)])
def test_qkv_rows_match_megatrons_split(heads, kv, tp):
    """Row by row: which canonical q/k/v row each local linear_qkv row holds."""
    spec = build_spec("a", ModelConfig("qwen3", 16, 1, heads, kv, 2, 24, vocab_size=64))
    layout = MegatronLayout(tp=tp).resolve(spec)
    want = mh.megatron_qkv_rows(heads, kv, 2, tp)
    for t in range(tp):
        qkv = next(x for x in layout.local_tensors(spec, t) if x.name.endswith("linear_qkv.weight"))
        got = [None] * qkv.shape[0]
        for p in qkv.pieces:
            kind = p.tensor.split(".")[-2][0]
            for i in range(p.size[1]):
                got[p.local_start[1] + i] = (kind, p.start[1] + i)
        assert got == [(kind, row) for kind, row, _ in want[t]], f"tp rank {t}"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_dense_fc1_rows_match_megatrons_split(tp):
    spec = build_spec("d", ModelConfig("llama", 16, 1, 4, 4, 4, 32, vocab_size=64))
    layout = MegatronLayout(tp=tp).resolve(spec)
    want = mh.megatron_fc1_rows(32, tp)
    for t in range(tp):
        fc1 = next(x for x in layout.local_tensors(spec, t) if x.name.endswith("mlp.linear_fc1.weight"))
        got = [None] * fc1.shape[0]
        for p in fc1.pieces:
            kind = "gate" if "gate_proj" in p.tensor else "up"
            for i in range(p.size[1]):
                got[p.local_start[1] + i] = (kind, p.start[1] + i)
        assert got == [(kind, row) for kind, row, _ in want[t]], f"tp rank {t}"


@pytest.mark.parametrize("tp,pp,ep,etp,vpp,tied", [
    (2, 1, 2, 1, None, False), (1, 2, 4, 1, None, True), (2, 2, 2, 2, 2, False), (1, 1, 1, 1, None, True),
])
def test_parameter_names_and_shapes_match_gptmodel(tp, pp, ep, etp, vpp, tied):
    """GPTModel's named_parameters (local spec, mapped to the TE spec's names that production uses:
    fused layer norms and grouped experts) equal refit's local tensors, rank by rank and chunk by chunk."""
    layers = 4
    spec = moe_spec(layers=layers, vocab=200)
    spec = build_spec("m", ModelConfig(**{**spec.config.__dict__, "tie_embeddings": tied}))
    layout = MegatronLayout(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp or 1).resolve(spec)
    padded = pad_to(200, VOCAB_DIVISIBLE_BY * tp)  # Megatron-LM pads before building the model
    got = mh.megatron_gpt_param_names(
        num_layers=layers, hidden_size=16, num_attention_heads=4, num_query_groups=2, kv_channels=4,
        ffn_hidden_size=32, moe_ffn_hidden_size=8, num_experts=4, vocab_size=padded, tp=tp, pp=pp, ep=ep, etp=etp,
        vpp=vpp, share_embeddings_and_output_weights=tied, qk_layernorm=True, moe_router_enable_expert_bias=False,
        world_size=layout.world_size, with_sharded=False)
    for rank in range(layout.world_size):
        ours = {(t.name, t.shape) for t in layout.local_tensors(spec, rank)}
        theirs = set()
        for (r, chunk), info in got.items():
            if r != rank:
                continue
            prefix = f"chunk{chunk}." if vpp else ""
            for name, shape in info["params"]:
                te_name = mh.te_spec_param_name(name, is_moe_layer=True)
                theirs.add((prefix + te_name, tuple(shape)))
        assert ours == theirs, f"rank {rank}: only refit {sorted(ours - theirs)[:3]}, only megatron {sorted(theirs - ours)[:3]}"
