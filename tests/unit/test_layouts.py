"""Layout strings, degree resolution, refusals with numbers, and hand-checked conventions (vLLM's
are checked against vLLM itself: tests/integration/test_vllm_conventions.py)."""

from __future__ import annotations

import pytest
import torch

from refit.errors import RefitError
from refit.layouts import resolve_layout
from refit.layouts.fsdp import chunk_rows
from refit.hf_checkpoint import load_spec
from refit.sides import Side
from tests.harness.tiny import tiny_spec

Q30 = load_spec("qwen3-30b-moe")


@pytest.mark.parametrize("text,role,expect", [
    ("tp4ep8", Side.TRAINER, "megatron:tp4ep8etp1dp2"),
    ("tp4ep8", Side.ENGINE, "vllm:tp4ep8dp2"),
    ("megatron:tp4pp4ep16", Side.TRAINER, "megatron:tp4pp4ep16etp1dp4"),
    ("megatron:tp2pp2vpp2", Side.TRAINER, "megatron:tp2pp2vpp2dp1"),
    ("megatron:tp4ep8etp4", Side.TRAINER, "megatron:tp4ep8etp4dp8"),
    ("megatron:tp2cp2ep4dp1", Side.TRAINER, "megatron:tp2cp2ep4etp1dp1"),
    ("vllm:tp8", Side.ENGINE, "vllm:tp8"),
    ("vllm:tp4ep4", Side.ENGINE, "vllm:tp4ep4"),
    ("vllm:tp8dp4", Side.ENGINE, "vllm:tp8dp4"),
    ("fsdp:dp8", Side.TRAINER, "fsdp:dp8"),
    ("megatron:tp4vocabdiv1", Side.TRAINER, "megatron:tp4dp1vocabdiv1"),
    ("megatron:tp4vocabdiv128", Side.TRAINER, "megatron:tp4dp1"),
    ("fsdp:dp4rep2", Side.TRAINER, "fsdp:dp4rep2"),
    ("fsdp:rep2dp4", Side.TRAINER, "fsdp:dp4rep2"),
    ("fsdp:fused1dp4", Side.TRAINER, "fsdp:dp4fused1"),
    ("fsdp:fused1rep2dp4", Side.TRAINER, "fsdp:dp4rep2fused1"),
    ("hf", Side.ENGINE, "hf"),
    ("  VLLM:TP2 ", Side.ENGINE, "vllm:tp2"),
])
def test_layout_strings_resolve_and_print_back(text, role, expect):
    layout = resolve_layout(text, Q30, role)
    assert layout.describe() == expect.split("first")[0] or layout.describe().startswith(expect)
    again = resolve_layout(layout.describe(), Q30, role)
    assert again == layout


def test_resolved_degrees_are_reported():
    d = resolve_layout("megatron:tp4pp4ep16", load_spec("qwen3-235b-moe")).details()
    assert d == {"tp": 4, "cp": 1, "dp": 4, "pp": 4, "vpp": 1, "ep": 16, "etp": 1, "edp": 1, "world_size": 64,
                 "first": 23, "last": 23}
    assert resolve_layout("vllm:tp4ep8", Q30, Side.ENGINE).details() == {"tp": 4, "dp": 2, "ep": 8, "world_size": 8}


@pytest.mark.parametrize("text,words", [
    ("megatron:tp3", ["attention heads (32)", "tp (3)"]),
    ("megatron:tp64", ["attention heads (32)", "tp (64)"]),
    ("megatron:tp4ep6", ["experts (128)", "ep (6)"]),
    ("megatron:tp4ep8dp1", ["tp*cp*dp", "etp*ep"]),
    ("megatron:tp2etp5ep2", ["moe_intermediate_size (768)", "etp (5)"]),
    ("megatron:pp7", ["layers (48)", "pp*vpp (7*1=7)", "first<N>"]),
    ("megatron:pp2vpp5", ["layers (48)", "pp*vpp (2*5=10)"]),
    ("megatron:vpp2", ["vpp > 1 needs pp > 1"]),
    ("megatron:first24", ["48 layers cannot be split as first=24, last=None over 0 middle stages"]),
    ("megatron:first48last48", ["48 layers cannot be split as first=48, last=48 over -1 middle stages"]),
    ("vllm:tp3", ["attention heads (32)", "tp (3)"]),
    ("vllm:tp4ep8dp1", ["tp*dp (4*1=4)", "ep8"]),
    ("vllm:tp32dp16", ["moe_intermediate_size (768)", "tp*dp"]),
    ("vllm:pp2", ["no 'pp' degree"]),
    ("deepspeed:tp2", ["unknown framework 'deepspeed'"]),
    ("megatron:tp2tp2", ["tp given twice"]),
    ("megatron:", ["cannot parse"]),
    ("megatron:tp2x", ["cannot parse", "'x'"]),
    ("fsdp:dp2fused2", ["fused is 1", "fused2"]),
])
def test_impossible_layouts_are_refused_with_numbers(text, words):
    with pytest.raises(RefitError) as e:
        resolve_layout(text, Q30, Side.ENGINE if text.startswith("vllm") else Side.TRAINER)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_vllm_vocab_padding_must_split_over_tp():
    from refit.spec import ModelConfig, build_spec

    spec = build_spec("six-heads", ModelConfig("llama", 12, 2, 6, 6, 2, 12, vocab_size=100))  # padded: 128
    resolve_layout("vllm:tp2", spec, Side.ENGINE)
    with pytest.raises(RefitError, match=r"vocab padded to a multiple of 64 \(128\) is not divisible by tp \(6\)"):
        resolve_layout("vllm:tp6", spec, Side.ENGINE)


def test_megatron_qkv_rows_must_split_over_tp():
    from refit.spec import ModelConfig, build_spec

    spec = build_spec("odd", ModelConfig("llama", 16, 2, 8, 1, 2, 16, vocab_size=100))  # (8+2)*2 = 20 rows
    resolve_layout("megatron:tp2", spec)
    with pytest.raises(RefitError, match=r"linear_qkv rows .* \(20\) is not divisible by tp \(8\)"):
        resolve_layout("megatron:tp8", spec)


def test_megatron_query_groups_must_be_a_multiple_or_divisor_of_tp():
    """megatron-core's TransformerConfig refuses num_query_groups neither a multiple nor a divisor
    of tp (Attention then cannot give each rank whole groups, or whole shares of one)."""
    from refit.spec import ModelConfig, build_spec

    # 12 heads, 3 kv heads, head_dim 4: linear_qkv rows (12+6)*4 = 72 split over tp2 and tp4 evenly
    spec = build_spec("three-groups", ModelConfig("llama", 48, 2, 12, 3, 4, 48, vocab_size=100))
    resolve_layout("megatron:tp3", spec)  # one group a rank
    resolve_layout("megatron:tp6", spec)  # half a group a rank
    for tp in (2, 4):
        with pytest.raises(RefitError, match=rf"query groups \(kv heads, 3\) must be a multiple or a divisor of "
                                             rf"tp \({tp}\)"):
            resolve_layout(f"megatron:tp{tp}", spec)


def test_megatron_first_on_one_pipeline_stage_is_every_layer():
    """megatron-core accepts num_layers_in_first_pipeline_stage = num_layers with pp 1 (no middle
    stages, no layers left); refit resolves it to the one stage holding them all."""
    layout = resolve_layout("megatron:first48", Q30)
    assert layout.stage_layers(48) == {(0, 0): list(range(48))}


def test_expert_parallel_on_a_dense_model_is_refused():
    with pytest.raises(RefitError, match="has no experts"):
        resolve_layout("megatron:tp2ep2", load_spec("qwen3-8b"))


def test_fused_experts_on_a_dense_model_are_refused():
    with pytest.raises(RefitError, match="holds fused experts, but qwen3-8b has none"):
        resolve_layout("fsdp:dp2fused1", load_spec("qwen3-8b"))


def test_fsdp_tp_on_a_moe_model_is_refused():
    with pytest.raises(RefitError, match="FSDP x TP is described for dense models only"):
        resolve_layout("fsdp:dp2tp2", Q30)


def test_fsdp_tp_boxes_are_what_torch_places():
    """dp2 x tp2 of q_proj [64, 64] and o_proj [64, 64] (a 4-head Llama of hidden 64): where torch's
    ColwiseParallel / RowwiseParallel then fully_shard put each rank's local shard (seen with
    DTensor on gloo): colwise rows at t * 32 + d * 16, rowwise rows d * 32 and columns t * 32;
    norms by dp rows only."""
    from refit.layouts.fsdp import FsdpLayout
    from refit.spec import ModelConfig, build_spec

    spec = build_spec("llama-64", ModelConfig.from_hf({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 129,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    layout = FsdpLayout(dp=2, tp=2).resolve(spec)
    for rank in range(4):
        d, t = rank // 2, rank % 2
        local = {lt.name: lt for lt in layout.local_tensors(spec, rank)}
        q = local["model.layers.0.self_attn.q_proj.weight"]
        o = local["model.layers.0.self_attn.o_proj.weight"]
        norm = local["model.layers.0.input_layernorm.weight"]
        embed = local["model.embed_tokens.weight"]  # 129 rows: tp chunks 65 / 64, then dp chunks
        assert q.shape == (16, 64) and q.pieces[0].start[-2:] == (t * 32 + d * 16, 0), (rank, q)
        assert o.shape == (32, 32) and o.pieces[0].start[-2:] == (d * 32, t * 32), (rank, o)
        assert norm.shape == (32,) and norm.pieces[0].start[-1] == d * 32
        assert embed.shape[0] == [33, 32, 32, 32][rank] and embed.pieces[0].start[-2] == [0, 65, 33, 97][rank]


def test_fsdp_fused_experts_are_whole_on_the_rank_holding_their_rows():
    """8 experts over 5 ranks split as torch.chunk splits the fused [E, ...] parameter: 2, 2, 2, 2,
    0; the other tensors (the router's [E, H] too) by rows as ever."""
    spec = tiny_spec("tiny-qwen3-moe")
    layout = resolve_layout("fsdp:dp5fused1", spec)
    for rank, held in enumerate(([0, 1], [2, 3], [4, 5], [6, 7], [])):
        local = {t.name: t for t in layout.local_tensors(spec, rank)}
        for e in range(spec.config.num_experts):
            t = local[f"model.layers.0.mlp.experts.{e}.down_proj.weight"]
            whole = spec.config.hidden_size
            assert t.shape[0] == (whole if e in held else 0) and len(t.pieces) == (e in held), (rank, e)
        gate = local["model.layers.0.mlp.gate.weight"]
        assert gate.shape[0] == [2, 2, 2, 2, 0][rank]


def test_megatron_qkv_rows_interleave_query_groups():
    """q heads 4, kv 2, head_dim 8: rank 0 of tp2 holds group 0 = [q0 q1; k0; v0]."""
    spec = tiny_spec("tiny-qwen3-moe")
    layout = resolve_layout("megatron:tp2", spec)
    qkv = next(t for t in layout.local_tensors(spec, 1) if t.name.endswith("linear_qkv.weight"))
    assert qkv.shape == (32, 32)
    got = [(p.tensor.split(".")[-2], p.start[1], p.size[1], p.local_start[1]) for p in qkv.pieces]
    assert got == [("q_proj", 16, 16, 0), ("k_proj", 8, 8, 16), ("v_proj", 8, 8, 24)]


# vLLM's kv heads replicated when tp exceeds them, experts placed with a remainder (E mod ep != 0),
# TP above 2 and experts split over a flattened dp x tp group: refit's `vllm:` layout is compared
# with what vLLM 0.32's own weight loaders put into every rank, element by element (TP=4 in a live
# engine, TP=8 and DP=2 by its loaders run per rank), and `expert_range` with vLLM's
# `determine_expert_map` over a grid of expert counts and EP sizes, in
# tests/integration/test_vllm_conventions.py (minutes).  The kv-head replication is held here too,
# at unit level, against what vLLM's loaders did, captured once:

# Which rows of q_proj / k_proj / v_proj each rank's qkv_proj holds, in order, for the tiny dense
# Qwen3 of tests/harness/vllm_capture/make_models.py (4 q heads, 2 kv heads, head_dim 64) at TP=4:
# vLLM 0.32's loaders run per rank (tests/harness/vllm_capture/direct.py, `DirectJob("dense-tp4",
# ckpt, tp=4)`), each captured row matched to the one checkpoint row equal to it.  Ranks 0 and 1
# hold kv head 0, ranks 2 and 3 kv head 1.
VLLM_QKV_ROWS_TP4 = {
    0: [("q_proj", 0, 64), ("k_proj", 0, 64), ("v_proj", 0, 64)],
    1: [("q_proj", 64, 64), ("k_proj", 0, 64), ("v_proj", 0, 64)],
    2: [("q_proj", 128, 64), ("k_proj", 64, 64), ("v_proj", 64, 64)],
    3: [("q_proj", 192, 64), ("k_proj", 64, 64), ("v_proj", 64, 64)],
}


def test_kv_heads_replicated_as_vllms_loaders_place_them() -> None:
    from refit.spec import ModelConfig, build_spec

    cfg = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=1000, hidden_size=128,
               intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=64, tie_word_embeddings=False, dtype="bfloat16")
    spec = build_spec("tiny-qwen3", ModelConfig.from_hf(cfg))
    layout = resolve_layout("vllm:tp4", spec, Side.ENGINE)
    for rank, want in VLLM_QKV_ROWS_TP4.items():
        qkv = next(t for t in layout.local_tensors(spec, rank) if t.name == "model.layers.0.self_attn.qkv_proj.weight")
        pieces = sorted(qkv.pieces, key=lambda p: p.local_start[1])  # in the local tensor's row order
        got = [(p.tensor.split(".")[-2], p.start[1], p.size[1]) for p in pieces]
        assert got == want, (rank, got)
        assert [p.local_start[1] for p in pieces] == [0, 64, 128]  # contiguous, nothing between


@pytest.mark.parametrize("n,ranks", [(10, 4), (3, 5), (8, 8), (7, 2), (1, 3)])
def test_fsdp_rows_follow_torch_chunk(n, ranks):
    chunks = torch.arange(n).chunk(ranks)
    for r in range(ranks):
        lo, size = chunk_rows(n, ranks, r)
        want = chunks[r].tolist() if r < len(chunks) else []
        assert list(range(lo, lo + size)) == want


def test_megatron_pipeline_stages_and_tied_output_layer():
    spec = tiny_spec("tiny-qwen2")  # tied embeddings
    layout = resolve_layout("megatron:pp2vpp2", spec)
    assert layout.stage_layers(4) == {(0, 0): [0], (1, 0): [1], (0, 1): [2], (1, 1): [3]}
    last = [t.name for t in layout.local_tensors(spec, 1)]
    assert "chunk1.output_layer.weight" in last and "chunk1.decoder.final_layernorm.weight" in last
    assert "chunk0.decoder.layers.0.self_attention.linear_qkv.bias" in last
    single = resolve_layout("megatron:tp1", spec)
    assert not any("output_layer" in t.name for t in single.local_tensors(spec, 0))
