"""The block-FP8 loading oracle (`tests/harness/vllm_fp8_loading.py`) against hand-computed slicing.

The oracle runs vLLM's own model construction and weight loaders for one TP rank; the tests that
check refit's FP8 placement trust what it returns, so here it is checked against the layout worked
out by hand from the checkpoint, bit for bit, on tiny random models whose sizes respect 128-blocks:

* Qwen3 dense (hidden 256, 2 heads x head_dim 128, 2 kv heads, intermediate 512, 2 layers) and
  Qwen3-MoE (the same attention, 4 experts of moe_intermediate 256), at TP 1 and on both ranks of
  TP 2; and every rank of a dense TP 4 with 4 q heads over 2 kv heads (kv heads replicated).
  The checkpoint is made by vLLM's own quantizer (``per_block_cast_to_fp8``) from random bf16
  weights: float8_e4m3fn weights and float32 ``weight_scale_inv`` of ``[ceil(N/128),
  ceil(K/128)]``; the bf16 embeddings, norms and router are in it too and must be ignored.
* Expected per rank: ``qkv_proj`` = the rank's q rows, then its k rows, then its v rows, and the
  scale rows the same in 128-row block units; ``gate_up_proj`` = gate rows then up rows;
  ``o_proj`` / ``down_proj`` = the rank's columns (scale columns in blocks); experts ``w13[e]`` =
  expert e's gate rows then up rows of the rank's share of the intermediate dim, ``w2[e]`` = its
  down columns, scales alike.  Names and the exact key set are vLLM's ``named_parameters()``
  names, dense and MoE.
* Refusals: TP 2 of a dense model whose intermediate half (192) is not a multiple of 128 raises
  vLLM's ``validate_fp8_block_shape`` ``ValueError`` (from ``down_proj``, the row-parallel cut;
  vLLM lets the merged ``gate_up_proj`` through), and so does a MoE whose per-rank expert
  intermediate (136) has no common block of 32 or more with 128.
* Not refused at ``create_weights`` but failing in vLLM's loader: a dense intermediate of 320 (a
  partial block) even at TP 1 (``RuntimeError`` of a narrow past gate_up's scale rows).
* A MoE whose per-rank intermediate (192) is not a multiple of 128 but shares a 64-block is *not*
  refused by vLLM 0.32: its expert scales are refined to 64 x 64 blocks (each checkpoint scale
  repeated 2 x 2, then sliced per rank).  Checked, so that refit is held to it (or refuses it).
* The oracle leaves the process as it found it: vLLM's parallel-state globals, ``os.environ``, the
  caller's checkpoint tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness.vllm_rl import vllm_marks

pytestmark = vllm_marks()

B = 128  # the checkpoints' weight block, both dims
QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [B, B]}
ATTN = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 128,
        "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
DENSE = {**ATTN, "model_type": "qwen3", "intermediate_size": 512, "quantization_config": QC}
MOE = {**ATTN, "model_type": "qwen3_moe", "intermediate_size": 512, "num_experts": 4, "num_experts_per_tok": 2,
       "moe_intermediate_size": 256, "norm_topk_prob": True, "decoder_sparse_step": 1, "quantization_config": QC}
LAYOUTS = [(1, 0), (2, 0), (2, 1)]  # (tp_size, tp_rank)


# ------------------------------------------------------------------------------------ checkpoints
def make_checkpoint(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """A random block-FP8 HF checkpoint of ``config``, quantized by vLLM's ``per_block_cast_to_fp8``
    (never zero: ``randn`` weights), with the bf16 tensors an FP8 checkpoint keeps unquantized."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    g = torch.Generator().manual_seed(seed)
    hidden, hd = config["hidden_size"], config["head_dim"]
    q_rows, kv_rows = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    ck: dict[str, torch.Tensor] = {}

    def add(name: str, n: int, k: int) -> None:
        w, s = per_block_cast_to_fp8(torch.randn(n, k, generator=g).to(torch.bfloat16), [B, B])
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert s.shape == (-(-n // B), -(-k // B))
        ck[f"{name}.weight"], ck[f"{name}.weight_scale_inv"] = w, s

    def bf16(name: str, *shape: int) -> None:
        ck[name] = torch.randn(*shape, generator=g).to(torch.bfloat16)

    bf16("model.embed_tokens.weight", config["vocab_size"], hidden)
    bf16("lm_head.weight", config["vocab_size"], hidden)
    bf16("model.norm.weight", hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        add(p + "self_attn.q_proj", q_rows, hidden)
        add(p + "self_attn.k_proj", kv_rows, hidden)
        add(p + "self_attn.v_proj", kv_rows, hidden)
        add(p + "self_attn.o_proj", hidden, q_rows)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            bf16(p + norm + ".weight", hidden)
        for norm in ("q_norm", "k_norm"):
            bf16(p + f"self_attn.{norm}.weight", hd)
        if config["model_type"] == "qwen3_moe":
            inter = config["moe_intermediate_size"]
            bf16(p + "mlp.gate.weight", config["num_experts"], hidden)  # the router
            for e in range(config["num_experts"]):
                add(p + f"mlp.experts.{e}.gate_proj", inter, hidden)
                add(p + f"mlp.experts.{e}.up_proj", inter, hidden)
                add(p + f"mlp.experts.{e}.down_proj", hidden, inter)
        else:
            inter = config["intermediate_size"]
            add(p + "mlp.gate_proj", inter, hidden)
            add(p + "mlp.up_proj", inter, hidden)
            add(p + "mlp.down_proj", hidden, inter)
    return ck


@pytest.fixture(scope="module")
def dense_ck() -> dict[str, torch.Tensor]:
    return make_checkpoint(DENSE, seed=1)


@pytest.fixture(scope="module")
def moe_ck() -> dict[str, torch.Tensor]:
    return make_checkpoint(MOE, seed=2)


# ------------------------------------------------------------------------- the layout by hand
def rows(t: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Rows ``[index*count, (index+1)*count)`` of ``t``: shard ``index`` of a split of dim 0."""
    return t[index * count:(index + 1) * count]


def cols(t: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Columns ``[index*count, (index+1)*count)`` of ``t``: shard ``index`` of a split of dim 1."""
    return t[:, index * count:(index + 1) * count]


def expected_attention(ck: dict[str, torch.Tensor], config: dict, tp: int, r: int) -> dict[str, torch.Tensor]:
    """Rank ``r`` of ``tp``'s attention parameters (qkv_proj, o_proj), sliced by hand from the
    checkpoint (every split here falls on 128-block bounds, so a weight share of n rows is a scale
    share of n/128 rows)."""
    hd, heads, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    nq = heads * hd // tp
    nkv = max(1, kv // tp) * hd
    kv_shard = r if kv >= tp else r // (tp // kv)  # kv heads replicated when tp exceeds them
    assert nq % B == 0 and nkv % B == 0
    out: dict[str, torch.Tensor] = {}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        (q, qs), (k, ks), (v, vs), (o, os_) = ((ck[f"{p}{n}_proj.weight"], ck[f"{p}{n}_proj.weight_scale_inv"])
                                               for n in "qkvo")
        out[p + "qkv_proj.weight"] = torch.cat([rows(q, r, nq), rows(k, kv_shard, nkv), rows(v, kv_shard, nkv)])
        out[p + "qkv_proj.weight_scale_inv"] = torch.cat(
            [rows(qs, r, nq // B), rows(ks, kv_shard, nkv // B), rows(vs, kv_shard, nkv // B)])
        out[p + "o_proj.weight"] = cols(o, r, nq)
        out[p + "o_proj.weight_scale_inv"] = cols(os_, r, nq // B)
    return out


def expected_rank(ck: dict[str, torch.Tensor], config: dict, tp: int, r: int) -> dict[str, torch.Tensor]:
    """Rank ``r`` of ``tp``'s FP8 parameters, sliced by hand: the attention's, then the dense MLP's
    (gate rows then up rows; down columns) or the experts' (per expert, the same)."""
    moe = config["model_type"] == "qwen3_moe"
    inter = (config["moe_intermediate_size"] if moe else config["intermediate_size"]) // tp
    assert inter % B == 0
    out = expected_attention(ck, config, tp, r)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."

        def w(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return ck[p + name + ".weight"], ck[p + name + ".weight_scale_inv"]

        if moe:
            experts = [tuple(w(f"mlp.experts.{e}.{n}_proj") for n in ("gate", "up", "down"))
                       for e in range(config["num_experts"])]
            e_ = "mlp.experts.routed_experts."
            out[p + e_ + "w13_weight"] = torch.stack(
                [torch.cat([rows(g, r, inter), rows(u, r, inter)]) for (g, _), (u, _), _ in experts])
            out[p + e_ + "w13_weight_scale_inv"] = torch.stack(
                [torch.cat([rows(gs, r, inter // B), rows(us, r, inter // B)]) for (_, gs), (_, us), _ in experts])
            out[p + e_ + "w2_weight"] = torch.stack([cols(d, r, inter) for _, _, (d, _) in experts])
            out[p + e_ + "w2_weight_scale_inv"] = torch.stack([cols(ds, r, inter // B) for _, _, (_, ds) in experts])
        else:
            (g, gs), (u, us), (d, ds) = (w(f"mlp.{n}_proj") for n in ("gate", "up", "down"))
            out[p + "mlp.gate_up_proj.weight"] = torch.cat([rows(g, r, inter), rows(u, r, inter)])
            out[p + "mlp.gate_up_proj.weight_scale_inv"] = torch.cat([rows(gs, r, inter // B), rows(us, r, inter // B)])
            out[p + "mlp.down_proj.weight"] = cols(d, r, inter)
            out[p + "mlp.down_proj.weight_scale_inv"] = cols(ds, r, inter // B)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit pattern (fp8 as uint8, bf16 as int16, float32 as int32): equality of these is bit equality,
    which also tells a NaN left by the oracle (an element no loader wrote) from any value."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), name
        assert torch.equal(bits(g), bits(w)), name


# ------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("tp,rank", LAYOUTS)
def test_dense_qwen3(dense_ck: dict[str, torch.Tensor], tp: int, rank: int) -> None:
    from tests.harness.vllm_fp8_loading import load_fp8_rank

    got = load_fp8_rank(dense_ck, DENSE, tp, rank)
    assert_same(got, expected_rank(dense_ck, DENSE, tp, rank))
    modules = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    assert sorted(got) == sorted(f"model.layers.{i}.{m}.{p}" for i in range(2) for m in modules
                                 for p in ("weight", "weight_scale_inv"))
    # spelled out: qkv = the q rows of the rank's share, then its k rows, then its v rows
    qkv, s = got["model.layers.0.self_attn.qkv_proj.weight"], got["model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
    n = 256 // tp  # q (and, 2 kv heads of 128, k and v) rows per rank
    assert qkv.shape == (3 * n, 256) and s.shape == (3 * n // B, 2)
    for j, name in enumerate("qkv"):
        w = dense_ck[f"model.layers.0.self_attn.{name}_proj.weight"]
        ws = dense_ck[f"model.layers.0.self_attn.{name}_proj.weight_scale_inv"]
        assert torch.equal(bits(qkv[j * n:(j + 1) * n]), bits(w[rank * n:(rank + 1) * n]))
        assert torch.equal(s[j * n // B:(j + 1) * n // B], ws[rank * n // B:(rank + 1) * n // B])


@pytest.mark.parametrize("tp,rank", LAYOUTS)
def test_moe_qwen3(moe_ck: dict[str, torch.Tensor], tp: int, rank: int) -> None:
    from tests.harness.vllm_fp8_loading import load_fp8_rank

    got = load_fp8_rank(moe_ck, MOE, tp, rank)
    assert_same(got, expected_rank(moe_ck, MOE, tp, rank))
    e_ = "mlp.experts.routed_experts."
    assert {n for n in got if ".layers.1." in n} == {f"model.layers.1.{s}" for s in (
        "self_attn.qkv_proj.weight", "self_attn.qkv_proj.weight_scale_inv", "self_attn.o_proj.weight",
        "self_attn.o_proj.weight_scale_inv", e_ + "w13_weight", e_ + "w13_weight_scale_inv", e_ + "w2_weight",
        e_ + "w2_weight_scale_inv")}
    inter = 256 // tp
    assert got[f"model.layers.0.{e_}w13_weight"].shape == (4, 2 * inter, 256)
    assert got[f"model.layers.0.{e_}w13_weight_scale_inv"].shape == (4, 2 * inter // B, 2)
    assert got[f"model.layers.0.{e_}w2_weight"].shape == (4, 256, inter)
    assert got[f"model.layers.0.{e_}w2_weight_scale_inv"].shape == (4, 2, inter // B)


@pytest.mark.parametrize("rank", range(4))
def test_dense_tp4_replicates_kv_heads(rank: int) -> None:
    """4 q heads, 2 kv heads at TP 4: one q head per rank, kv head ``rank // 2`` (its 128 rows and
    its one scale row) on two ranks each."""
    from tests.harness.vllm_fp8_loading import load_fp8_rank

    config = {**DENSE, "num_attention_heads": 4, "num_hidden_layers": 1}
    ck = make_checkpoint(config, seed=4)
    got = load_fp8_rank(ck, config, 4, rank)
    assert_same(got, expected_rank(ck, config, 4, rank))
    k = ck["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(bits(got["model.layers.0.self_attn.qkv_proj.weight"][128:256]), bits(rows(k, rank // 2, 128)))


def test_dense_block_cut_by_tp_is_refused() -> None:
    """intermediate 384 at TP 2: each rank's 192 columns of down_proj cut a 128-block."""
    from tests.harness.vllm_fp8_loading import load_fp8_rank

    config = {**DENSE, "intermediate_size": 384}
    with pytest.raises(ValueError, match=r"input_size_per_partition = 192 is not divisible by weight "
                                         r"quantization block_k = 128"):
        load_fp8_rank({}, config, 2, 1)


def test_moe_block_cut_by_tp_is_refused() -> None:
    """moe_intermediate 272 at TP 2: 136 per rank, no refined block of 32 or more divides it."""
    from tests.harness.vllm_fp8_loading import load_fp8_rank

    config = {**MOE, "moe_intermediate_size": 272}
    with pytest.raises(ValueError, match=r"output_size of gate's and up's weight = 136 is not divisible"):
        load_fp8_rank({}, config, 2, 0)


def test_partial_block_fails_in_the_loader() -> None:
    """intermediate 320 (two and a half blocks) even at TP 1: vLLM skips the block-shape check for
    a merged layer whose parts are not block multiples, sizes gate_up's scale by the fused rows
    (ceil(640/128) = 5), then places up's scales at block offset ceil(320/128) = 3, three rows,
    past the end: the loader's narrow raises, the oracle with it."""
    from tests.harness.vllm_fp8_loading import load_fp8_rank

    config = {**DENSE, "intermediate_size": 320, "num_hidden_layers": 1}
    with pytest.raises(RuntimeError, match=r"start \(3\) \+ length \(3\) exceeds dimension size \(5\)"):
        load_fp8_rank(make_checkpoint(config, seed=5), config, 1, 0)


def test_moe_half_block_share_refines_scales() -> None:
    """moe_intermediate 384 at TP 2: 192 per rank is not a multiple of 128, but vLLM refines the
    expert scales to 64 x 64 blocks (each checkpoint scale repeated 2 x 2, lossless) and slices
    those; the attention keeps 128-blocks."""
    from tests.harness.vllm_fp8_loading import load_fp8_rank

    config = {**MOE, "moe_intermediate_size": 384, "num_hidden_layers": 1}
    ck = make_checkpoint(config, seed=3)
    up2 = lambda s: s.repeat_interleave(2, dim=0).repeat_interleave(2, dim=1)  # noqa: E731
    p, e_ = "model.layers.0.", "mlp.experts.routed_experts."
    for rank in range(2):
        got = load_fp8_rank(ck, config, 2, rank)
        w13_s, w2_s = got[p + e_ + "w13_weight_scale_inv"], got[p + e_ + "w2_weight_scale_inv"]
        assert w13_s.shape == (4, 2 * 192 // 64, 256 // 64) and w2_s.shape == (4, 256 // 64, 192 // 64)
        for e in range(4):
            ex = p + f"mlp.experts.{e}."
            gate_s, up_s, down_s = (up2(ck[ex + f"{n}_proj.weight_scale_inv"]) for n in ("gate", "up", "down"))
            assert torch.equal(w13_s[e], torch.cat([rows(gate_s, rank, 3), rows(up_s, rank, 3)]))
            assert torch.equal(w2_s[e], cols(down_s, rank, 3))
            w13 = torch.cat([rows(ck[ex + "gate_proj.weight"], rank, 192), rows(ck[ex + "up_proj.weight"], rank, 192)])
            assert torch.equal(bits(got[p + e_ + "w13_weight"][e]), bits(w13))
            assert torch.equal(bits(got[p + e_ + "w2_weight"][e]), bits(cols(ck[ex + "down_proj.weight"], rank, 192)))
        assert_same({n: t for n, t in got.items() if "self_attn" in n}, expected_attention(ck, config, 2, rank))


def test_leaves_the_process_as_it_was(dense_ck: dict[str, torch.Tensor]) -> None:
    from vllm.distributed import parallel_state as ps

    from tests.harness.vllm_fp8_loading import load_fp8_rank

    env, groups = dict(os.environ), (ps._TP, ps._DP, ps._EP, ps._PCP, ps._PP)
    before = {n: (t.data_ptr(), bits(t).clone(), set(vars(t))) for n, t in dense_ck.items()}
    load_fp8_rank(dense_ck, DENSE, 2, 1)
    assert dict(os.environ) == env
    assert (ps._TP, ps._DP, ps._EP, ps._PCP, ps._PP) == groups
    for n, t in dense_ck.items():  # same tensor objects, same bits, no attribute (shard_id) added
        ptr, b, attrs = before[n]
        assert t.data_ptr() == ptr and torch.equal(bits(t), b) and set(vars(t)) == attrs, n
