"""Fused QKV row layout:

* ``megatron_qkv_rows``               -> a real ``SelfAttention`` (local spec) per TP rank, weights
  initialised through Megatron's own CPU master-weight split, then
  ``SelfAttention.get_query_key_value_tensors`` (subprocess)
"""

from __future__ import annotations

from tests.harness.megatron.cpu import fake_world, install_cpu_shims, teardown_world
from tests.harness.megatron.worker import register, run_subprocess


def megatron_qkv_rows(
    num_heads: int, num_kv_heads: int, head_dim: int, tp: int
) -> list[list[tuple[str, int, int]]]:
    """For each TP rank, for each row of that rank's local ``linear_qkv.weight``:
    ``(kind, canonical_row, global_megatron_row)`` where kind is 'q'|'k'|'v',
    canonical_row indexes HF ``q_proj/k_proj/v_proj.weight`` rows (head*head_dim + d) and
    global_megatron_row is the row of the unsharded (checkpoint / master) ``linear_qkv.weight``.

    How it is determined (all Megatron code, per TP rank t, fake process groups):
      * a real ``SelfAttention`` is built from ``get_gpt_layer_local_spec()`` with
        ``use_cpu_initialization=True``; ``init_method`` writes the master-row index into column 0
        of the master weight, so ``_initialize_affine_weight_cpu``'s split tells which global rows
        rank t holds; ``output_layer_init_method`` likewise writes the column index into row 0 of
        ``linear_proj``'s master weight, so rank t's local attention-output slot j*hd+d is
        global o_proj input column code -> global q head = code // head_dim.
      * ``SelfAttention.get_query_key_value_tensors(e_0)`` (which runs ``linear_qkv`` forward and
        Megatron's split) returns query [1,1,np,hd], key/value [1,1,ng,hd] filled with the global
        row codes.  When num_kv_heads < tp Megatron all-gathers mixed_qkv over TP first; with
        fake groups that all-gather is replaced by the concatenation of the ranks' real local
        ``linear_qkv`` outputs (the only substitution).
      * local kv slot g serves local q heads j with j // (np/ng) == g (DotProductAttention's
        ``repeat_interleave``), so its global kv head = global_q_head(j) // (num_heads/num_kv_heads)
        (the HF GQA convention); all local q heads of a slot must agree, which is asserted.
    """
    res = run_subprocess(
        "qkv_rows", num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, tp=tp
    )
    return [[tuple(x) for x in rank_rows] for rank_rows in res]


@register("qkv_rows")
def _impl_qkv_rows(num_heads, num_kv_heads, head_dim, tp):
    install_cpu_shims()
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import attention as attn_mod
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    hidden = 4

    def enc_rows(w):
        with torch.no_grad():
            w.zero_()
            w[:, 0] = torch.arange(w.shape[0], dtype=w.dtype)

    def enc_cols(w):
        with torch.no_grad():
            w.zero_()
            w[0, :] = torch.arange(w.shape[1], dtype=w.dtype)

    attn_spec = get_gpt_layer_local_spec().submodules.self_attention

    def build(rank):
        fake_world(rank, tp)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
        cfg = TransformerConfig(
            num_layers=1,
            hidden_size=hidden,
            num_attention_heads=num_heads,
            num_query_groups=num_kv_heads,
            kv_channels=head_dim,
            tensor_model_parallel_size=tp,
            use_cpu_initialization=True,
            add_bias_linear=False,
            init_method=enc_rows,
            output_layer_init_method=enc_cols,
            params_dtype=torch.float64,
        )
        return build_module(attn_spec, config=cfg, layer_number=1)

    x = torch.zeros(1, 1, hidden, dtype=torch.float64)
    x[..., 0] = 1.0

    # pass 1: local weight row codes + local mixed_qkv (needed to emulate the TP all-gather)
    local_codes, local_mixed, proj_cols = [], [], []
    for t in range(tp):
        try:
            a = build(t)
            with torch.no_grad():
                local_codes.append([int(v) for v in a.linear_qkv.weight[:, 0].tolist()])
                mixed, _ = a.linear_qkv(x)
                local_mixed.append(mixed.clone())
                proj_cols.append([int(v) for v in a.linear_proj.weight[0, :].tolist()])
        finally:
            teardown_world()

    real_ag = attn_mod.all_gather_last_dim_from_tensor_parallel_region
    attn_mod.all_gather_last_dim_from_tensor_parallel_region = lambda t_, *a_, **k_: torch.cat(
        local_mixed, dim=-1
    )
    code_map: dict[int, tuple[str, int]] = {}

    def put(code, val):
        old = code_map.setdefault(code, val)
        assert old == val, f"inconsistent mapping for megatron row {code}: {old} vs {val}"

    group_size = num_heads // num_kv_heads
    try:
        for t in range(tp):
            try:
                a = build(t)
                with torch.no_grad():
                    q, k, v = a.get_query_key_value_tensors(x, None)
                np_, ng = q.shape[2], k.shape[2]
                # per-rank q heads after Megatron's own sub-selection (kv < tp case): nh / tp
                assert np_ == num_heads // tp, (np_, num_heads, tp)
                assert ng == a.num_query_groups_per_partition
                per_slot = np_ // ng
                slot_kv_head: dict[int, int] = {}
                for j in range(np_):
                    col_codes = proj_cols[t][j * head_dim : (j + 1) * head_dim]
                    gh = col_codes[0] // head_dim
                    assert col_codes == list(range(gh * head_dim, (gh + 1) * head_dim))
                    for d in range(head_dim):
                        put(int(q[0, 0, j, d].item()), ("q", gh * head_dim + d))
                    kvh = gh // group_size
                    g = j // per_slot
                    assert slot_kv_head.setdefault(g, kvh) == kvh, "q heads of one kv slot disagree"
                for g in range(ng):
                    kvh = slot_kv_head[g]
                    for d in range(head_dim):
                        put(int(k[0, 0, g, d].item()), ("k", kvh * head_dim + d))
                        put(int(v[0, 0, g, d].item()), ("v", kvh * head_dim + d))
            finally:
                teardown_world()
    finally:
        attn_mod.all_gather_last_dim_from_tensor_parallel_region = real_ag

    total = (num_heads + 2 * num_kv_heads) * head_dim
    assert sorted(code_map) == list(range(total)), "not every megatron row was identified"
    for kind, n in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads)):
        rows = sorted(c for (kk, c) in code_map.values() if kk == kind)
        assert rows == list(range(n * head_dim)), kind
    return [[[*code_map[c], c] for c in local_codes[t]] for t in range(tp)]
