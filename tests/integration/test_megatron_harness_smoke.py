"""Smoke tests for tests/harness/megatron/ (Megatron-Core ground truth on CPU).

Each subprocess-backed harness call costs ~5 s (fresh interpreter importing megatron.core);
results are cached per argument set, so the calls below are shared between tests.
"""

import pytest

pytest.importorskip("megatron.core")

from tests.harness import megatron as mh  # noqa: E402

KEYS = {"tp", "cp", "dp", "pp", "etp", "ep", "edp"}


# ---------------------------------------------------------------- rank coords


def test_rank_coords_tp2_pp2_ep2_etp1_world8():
    coords = mh.megatron_rank_coords(8, tp=2, pp=2, cp=1, ep=2, etp=1)
    assert len(coords) == 8
    assert all(set(c) == KEYS for c in coords)
    # order tp-cp-ep-dp-pp: tp fastest, pp slowest
    assert [c["tp"] for c in coords] == [0, 1] * 4
    assert [c["dp"] for c in coords] == [0, 0, 1, 1] * 2
    assert [c["pp"] for c in coords] == [0] * 4 + [1] * 4
    # expert grid etp=1, ep=2, edp=2: ep fastest
    assert [c["etp"] for c in coords] == [0] * 8
    assert [c["ep"] for c in coords] == [0, 1] * 4
    assert [c["edp"] for c in coords] == [0, 0, 1, 1] * 2
    # every rank has a unique (tp,cp,dp,pp) and a unique (etp,ep,edp,pp)
    assert len({(c["tp"], c["cp"], c["dp"], c["pp"]) for c in coords}) == 8
    assert len({(c["etp"], c["ep"], c["edp"], c["pp"]) for c in coords}) == 8


def test_rank_coords_etp_defaults_to_tp_and_cp():
    coords = mh.megatron_rank_coords(16, tp=2, pp=2, cp=2, ep=2)
    assert [c["etp"] for c in coords] == [c["tp"] for c in coords]
    assert [c["cp"] for c in coords][:8] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_rank_coords_rejects_bad_world():
    with pytest.raises(RuntimeError):
        mh.megatron_rank_coords(6, tp=4, pp=1, cp=1, ep=1, etp=None)
    with pytest.raises(RuntimeError):
        mh.megatron_rank_coords(8, tp=2, pp=2, cp=1, ep=4, etp=2)


def test_rank_coords_match_initialize_model_parallel():
    for args in [(8, 2, 2, 1, 2, 1), (16, 2, 2, 2, 2, 1)]:
        a = mh.megatron_rank_coords(*args)
        b = mh.megatron_rank_coords_via_initialize(*args)
        assert a == b, args


# ---------------------------------------------------------------- layer ids


def _check_partition(ids, num_layers):
    order = [x for k in sorted(ids, key=lambda k: (k[1], k[0])) for x in ids[k]]
    assert order == list(range(num_layers))


def test_layer_ids_even_and_vpp():
    ids = mh.megatron_layer_ids(8, pp=2, vpp=2)
    assert ids == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}
    ids = mh.megatron_layer_ids(8, pp=2, vpp=None)
    assert ids == {(0, 0): [0, 1, 2, 3], (1, 0): [4, 5, 6, 7]}


def test_layer_ids_uneven_and_accounting():
    ids = mh.megatron_layer_ids(7, pp=3, vpp=None, first=1, last=2)
    assert ids == {(0, 0): [0], (1, 0): [1, 2, 3, 4], (2, 0): [5, 6]}
    ids = mh.megatron_layer_ids(12, pp=4, vpp=2, first=2, last=2)
    _check_partition(ids, 12)
    assert ids[(0, 0)] == [0] and ids[(0, 1)] == [6]
    ids = mh.megatron_layer_ids(6, pp=2, vpp=None, account_for_embedding=True, account_for_loss=True)
    assert ids == {(0, 0): [0, 1, 2], (1, 0): [3, 4, 5]}
    ids = mh.megatron_layer_ids(8, pp=2, vpp=None, layout="Et|tt|tt|tttL")
    assert ids == {(0, 0): [0], (1, 0): [1, 2], (0, 1): [3, 4], (1, 1): [5, 6, 7]}


def test_layer_ids_rejections():
    with pytest.raises(AssertionError):  # get_num_layers_to_build
        mh.megatron_layer_ids(7, pp=2, vpp=None)
    with pytest.raises(ValueError):  # TransformerConfig.__post_init__
        mh.megatron_layer_ids(8, pp=3, vpp=None, first=3)  # 5 layers on 2 remaining stages
    assert mh.megatron_layer_ids(8, pp=2, vpp=None, first=3) == {(0, 0): [0, 1, 2], (1, 0): [3, 4, 5, 6, 7]}
    with pytest.raises(ZeroDivisionError):  # Megatron bug: uneven first+last, no middle stage, vpp
        mh.megatron_layer_ids(4, pp=2, vpp=2, first=2, last=2)
    with pytest.raises(ValueError):
        mh.megatron_layer_ids(8, pp=2, vpp=None, first=1, account_for_embedding=True)


# ---------------------------------------------------------------- qkv / fc1


def _check_qkv(rows, nh, nkv, hd, tp):
    assert len(rows) == tp
    per = (nh + 2 * nkv) * hd // tp
    assert all(len(r) == per for r in rows)
    flat = [x for r in rows for x in r]
    # flat concatenation over ranks is the unsharded megatron row order
    assert [x[2] for x in flat] == list(range((nh + 2 * nkv) * hd))
    for kind, n in (("q", nh), ("k", nkv), ("v", nkv)):
        assert sorted(x[1] for x in flat if x[0] == kind) == list(range(n * hd))
    return flat


def test_qkv_rows_gqa_interleave():
    nh, nkv, hd, tp = 4, 2, 2, 2
    rows = mh.megatron_qkv_rows(nh, nkv, hd, tp)
    flat = _check_qkv(rows, nh, nkv, hd, tp)
    # per kv group g: [q heads of g, k_g, v_g]
    assert [(k, r) for k, r, _ in flat[:8]] == [
        ("q", 0), ("q", 1), ("q", 2), ("q", 3), ("k", 0), ("k", 1), ("v", 0), ("v", 1)
    ]
    assert rows[1][0][:2] == ("q", 4)


def test_qkv_rows_kv_heads_less_than_tp():
    nh, nkv, hd, tp = 4, 1, 2, 2
    rows = mh.megatron_qkv_rows(nh, nkv, hd, tp)
    _check_qkv(rows, nh, nkv, hd, tp)
    assert [x[0] for x in rows[0]] == ["q"] * 6  # flat shard, no kv on rank 0


def test_fc1_rows_gate_up_per_shard():
    rows = mh.megatron_fc1_rows(4, 2)
    assert rows == [
        [("gate", 0, 0), ("gate", 1, 1), ("up", 0, 4), ("up", 1, 5)],
        [("gate", 2, 2), ("gate", 3, 3), ("up", 2, 6), ("up", 3, 7)],
    ]
    assert mh.megatron_fc1_checkpoint_offsets(4, 2) == [
        [(0, 2, 0), (2, 4, 4)],
        [(0, 2, 2), (2, 4, 6)],
    ]


# ---------------------------------------------------------------- GPT names


@pytest.fixture(scope="module")
def gpt_tp2_pp2_ep2():
    return mh.megatron_gpt_param_names(
        num_layers=4,
        tp=2,
        pp=2,
        ep=2,
        etp=1,
        vpp=2,
        moe_layer_freq=[0, 1, 1, 1],
        share_embeddings_and_output_weights=True,
    )


def test_gpt_param_names_structure(gpt_tp2_pp2_ep2):
    r = gpt_tp2_pp2_ep2
    assert set(r) == {(rk, v) for rk in range(4) for v in range(2)}
    # layer numbers agree with megatron_layer_ids
    ids = mh.megatron_layer_ids(4, pp=2, vpp=2)
    for (rk, v), e in r.items():
        assert e["layer_numbers"] == ids[(e["coords"]["pp"], v)]
    first = dict(r[(0, 0)]["params"])
    last = dict(r[(3, 1)]["params"])
    assert first["embedding.word_embeddings.weight"] == (64, 16)  # vocab 128 / tp 2
    assert "output_layer.weight" not in first
    assert last["output_layer.weight"] == (64, 16)  # tied copy on last stage (pp > 1)
    assert last["decoder.final_layernorm.weight"] == (16,)
    assert last["decoder.layers.0.mlp.router.weight"] == (4, 16)
    assert last["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"] == (16, 16)
    assert last["decoder.layers.0.self_attention.q_layernorm.weight"] == (4,)
    assert ("decoder.layers.0.mlp.router.expert_bias", (4,)) in r[(3, 1)]["buffers"]
    dense = dict(r[(0, 0)]["params"])
    assert dense["decoder.layers.0.mlp.linear_fc1.weight"] == (32, 16)  # 2*ffn/tp
    # ep rank 1 holds global experts 2,3
    assert r[(3, 1)]["coords"]["ep"] == 1
    assert r[(3, 1)]["local_expert_indices"] == {"decoder.layers.0.mlp": [2, 3]}
    sh = {(a, tuple(f)) : b for a, b, c, d, f in r[(3, 1)]["sharded"]}
    assert sh[("output_layer.weight", (64, 0))] == "embedding.word_embeddings.weight"
    assert sh[("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight", (2, 0, 0))] == (
        "decoder.layers.3.mlp.experts.experts.linear_fc2.weight"
    )


def test_gpt_single_rank_tied_has_no_output_layer():
    r = mh.megatron_gpt_param_names(num_layers=1, share_embeddings_and_output_weights=True,
                                    with_sharded=False)
    names = [n for n, _ in r[(0, 0)]["params"]]
    assert "output_layer.weight" not in names
    assert "embedding.word_embeddings.weight" in names


def test_te_name_mapping():
    f = mh.te_spec_param_name
    assert f("decoder.layers.0.input_layernorm.weight", False) == (
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    )
    assert f("decoder.layers.0.pre_mlp_layernorm.weight", False) == (
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    )
    assert f("decoder.layers.0.pre_mlp_layernorm.weight", True) == (
        "decoder.layers.0.pre_mlp_layernorm.weight"
    )
    assert f("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight", True) == (
        "decoder.layers.0.mlp.experts.linear_fc2.weight3"
    )
