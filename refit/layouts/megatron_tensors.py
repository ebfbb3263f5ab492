"""Megatron-Core's tensors of one decoder or MTP layer on one rank, as pieces of canonical tensors.

`MegatronLayout.local_tensors` walks a rank's pipeline chunks and calls these per layer: attention
(GQA's interleaved ``linear_qkv``, or MLA), the dense MLP, the MoE layer (router, shared and routed
experts) and the MTP layers of a drafter spec.  They are apart from `refit.layouts.megatron` because
they are the bulk of it and read only a few of the layout's degrees (tp, ep, etp, local); the
layout's degrees, validation, pipeline split and rank order stay there, and the conventions both
follow are written in that module's docstring.  Planning code: no torch.
"""

from __future__ import annotations

from typing import Protocol

from refit.drafters import mtp_layers
from refit.layouts.base import LocalTensor, Piece
from refit.spec import ModelSpec



class LayerDegrees(Protocol):
    """The degrees these functions read of a `refit.layouts.megatron.MegatronLayout` (which imports
    this module: described here, not imported)."""

    @property
    def tp(self) -> int: ...
    @property
    def ep(self) -> int: ...
    @property
    def local(self) -> int: ...
    @property
    def etp_(self) -> int: ...


def mtp_tensors(layout: LayerDegrees, spec: ModelSpec, co: dict[str, int]) -> list[LocalTensor]:
    """The MTP layers of a drafter spec (every rank of the last stage holds all of them)."""
    c = spec.config
    t, H, dt = co["tp"], c.hidden_size, c.dtype
    rows = H // layout.tp
    eh = "model.layers.*.eh_proj.weight"
    out: list[LocalTensor] = []
    for i, layer in enumerate(mtp_layers(c)):
        p = f"mtp.layers.{i}."
        out += [whole_tensor(spec, p + "enorm.weight", "model.layers.*.enorm.weight", layer),
                whole_tensor(spec, p + "hnorm.weight", "model.layers.*.hnorm.weight", layer),
                LocalTensor(p + "eh_proj.weight", (rows, 2 * H), dt,
                            (Piece(eh, (spec.layer_pos(eh, layer), t * rows, 0), (1, rows, 2 * H), (0, 0, 0)),))]
        out.extend(attention_tensors(layout, spec, p + "transformer_layer.", layer, t))
        if layer in c.moe_layers:
            out.extend(moe_tensors(layout, spec, p + "transformer_layer.", layer, co))
        else:
            out.extend(dense_mlp_tensors(layout, spec, p + "transformer_layer.", layer, t))
        out.append(whole_tensor(spec, p + "final_layernorm.weight", "model.layers.*.shared_head.norm.weight", layer))
    return out


def attention_tensors(layout: LayerDegrees, spec: ModelSpec, p: str, layer: int, t: int) -> list[LocalTensor]:
    """Self-attention of layer ``layer`` on tp rank ``t``, local names under ``p``: GQA's interleaved
    ``linear_qkv`` and its norms, or MLA (`mla_tensors`)."""
    c = spec.config
    if c.is_mla:
        return mla_tensors(layout, spec, p, layer, t)
    T, H, hd, dt = layout.tp, c.hidden_size, c.head_dim, c.dtype
    G = c.num_kv_heads
    q_per_g = c.num_heads // G
    # The full linear_qkv stacks, per query group g, [q heads of g; k_g; v_g]; rank t holds the
    # contiguous rows [t*R/T, (t+1)*R/T).  When G >= T that is whole groups; when G < T Megatron
    # still cuts the rows evenly (it all-gathers the qkv output before splitting heads).
    group_rows = (q_per_g + 2) * hd
    rows = G * group_rows // T
    lo, hi = t * rows, (t + 1) * rows
    out: list[LocalTensor] = []
    name = "model.layers.*.self_attn.{}_proj.{}"
    for kind in ("weight", "bias") if c.qkv_bias else ("weight",):
        pieces = []
        for g in range(lo // group_rows, -(-hi // group_rows)):
            at = g * group_rows  # row of the full interleaved matrix where this part starts
            for proj, c0, n in (("q", g * q_per_g * hd, q_per_g * hd), ("k", g * hd, hd), ("v", g * hd, hd)):
                a, b = max(at, lo), min(at + n, hi)
                if a < b:
                    tensor = name.format(proj, kind)
                    pos = spec.layer_pos(tensor, layer)
                    if kind == "weight":
                        pieces.append(Piece(tensor, (pos, c0 + a - at, 0), (1, b - a, H), (0, a - lo, 0)))
                    else:
                        pieces.append(Piece(tensor, (pos, c0 + a - at), (1, b - a), (0, a - lo)))
                at += n
        shape = (rows, H) if kind == "weight" else (rows,)
        out.append(LocalTensor(f"{p}self_attention.linear_qkv.{kind}", shape, dt, tuple(pieces)))

    norms = [("linear_qkv.layer_norm_weight", "input_layernorm.weight")]
    if c.qk_norm:
        norms += [("q_layernorm.weight", "self_attn.q_norm.weight"), ("k_layernorm.weight", "self_attn.k_norm.weight")]
    out += [whole_tensor(spec, f"{p}self_attention.{local}", f"model.layers.*.{hf}", layer) for local, hf in norms]
    o = "model.layers.*.self_attn.o_proj.weight"
    cols = c.num_heads * hd // T
    out.append(LocalTensor(f"{p}self_attention.linear_proj.weight", (H, cols), dt,
                           (Piece(o, (spec.layer_pos(o, layer), 0, t * cols), (1, H, cols), (0, 0, 0)),)))
    return out


def dense_mlp_tensors(layout: LayerDegrees, spec: ModelSpec, p: str, layer: int, t: int,
                      shared: bool = False) -> list[LocalTensor]:
    """A dense MLP (or with ``shared`` the shared experts) of layer ``layer`` on tp rank ``t``: [gate; up]
    rows in ``linear_fc1``, down split on dim 1 in ``linear_fc2``."""
    c = spec.config
    width, hf, mp = ((c.shared_intermediate_size, "mlp.shared_experts", "mlp.shared_experts") if shared
                     else (c.intermediate_size, "mlp", "mlp"))
    H, dt, n = c.hidden_size, c.dtype, width // layout.tp
    gate, up, down = (f"model.layers.*.{hf}.{x}_proj.weight" for x in ("gate", "up", "down"))
    ln = "model.layers.*.post_attention_layernorm.weight"
    pos = spec.layer_pos(gate, layer)
    # a dense layer fuses the pre-MLP norm into linear_fc1; shared experts sit after pre_mlp_layernorm
    norm = [] if shared else [whole_tensor(spec, f"{p}mlp.linear_fc1.layer_norm_weight", ln, layer)]
    return norm + [
        LocalTensor(f"{p}{mp}.linear_fc1.weight", (2 * n, H), dt,
                    (Piece(gate, (pos, t * n, 0), (1, n, H), (0, 0, 0)),
                     Piece(up, (pos, t * n, 0), (1, n, H), (0, n, 0)))),
        LocalTensor(f"{p}{mp}.linear_fc2.weight", (H, n), dt,
                    (Piece(down, (pos, 0, t * n), (1, H, n), (0, 0, 0)),)),
    ]


def moe_tensors(layout: LayerDegrees, spec: ModelSpec, p: str, layer: int, co: dict[str, int]
                ) -> list[LocalTensor]:
    """An MoE layer's norm, router, shared experts and the experts of the rank at coordinates ``co``
    (TE grouped-GEMM names, local expert i of ep rank k being global expert k*E/EP + i)."""
    c = spec.config
    H, dt, E = c.hidden_size, c.dtype, c.num_experts
    n = c.moe_intermediate_size // layout.etp_
    lo = co["etp"] * n
    ln = "model.layers.*.post_attention_layernorm.weight"
    router = "model.layers.*.mlp.gate.weight"
    gate, up, down = (f"model.layers.*.mlp.experts.*.{x}_proj.weight" for x in ("gate", "up", "down"))
    pos = spec.layer_pos(gate, layer)
    out = [whole_tensor(spec, f"{p}pre_mlp_layernorm.weight", ln, layer),
           whole_tensor(spec, f"{p}mlp.router.weight", router, layer)]
    if c.router_bias:  # TopKRouter's expert_bias buffer (moe_router_enable_expert_bias), float32 in the spec
        bias = "model.layers.*.mlp.gate.e_score_correction_bias"
        out.append(whole_tensor(spec, f"{p}mlp.router.expert_bias", bias, layer))
    if c.num_shared_experts:  # SharedExpertMLP: an MLP split over tp (not etp)
        out.extend(dense_mlp_tensors(layout, spec, p, layer, co["tp"], shared=True))
    per_rank = E // layout.ep
    e0 = co["ep"] * per_rank
    zero, up_at, fc1_shape, fc2_shape = (0, 0, 0, 0), (0, 0, n, 0), (2 * n, H), (H, n)
    fc1_size, fc2_size = (1, 1, n, H), (1, 1, H, n)
    # Hot loop (an EP rank holds E/EP experts in every layer): plain tuples, no lookups.
    for i in range(per_rank):
        at = (pos, e0 + i, lo, 0)
        out.append(LocalTensor(f"{p}mlp.experts.linear_fc1.weight{i}", fc1_shape, dt,
                               (Piece(gate, at, fc1_size, zero), Piece(up, at, fc1_size, up_at))))
    for i in range(per_rank):
        out.append(LocalTensor(f"{p}mlp.experts.linear_fc2.weight{i}", fc2_shape, dt,
                               (Piece(down, (pos, e0 + i, 0, lo), fc2_size, zero),)))
    return out


def mla_tensors(layout: LayerDegrees, spec: ModelSpec, p: str, layer: int, t: int) -> list[LocalTensor]:
    """MLASelfAttention with qk_layernorm (as DeepSeek-V3 recipes run it).  Under the
    Transformer Engine spec the down-projections are TELinear ``duplicated`` (whole on every tp
    rank); under the local spec (``local``) ColumnParallelLinear, their rows split contiguously
    over tp (the attention gathers their outputs before the q_a/kv_a norms).  The norms are
    whole either way (TE fuses them into the up-projections as ``layer_norm_weight``; attach
    maps the local spec's ``q_layernorm`` / ``kv_layernorm`` to those names); the
    up-projections are split by heads (contiguous rows), linear_proj on dim 1."""
    c = spec.config
    T, dt = layout.tp, c.dtype
    a = f"{p}self_attention."

    def whole(local: str, tensor: str) -> LocalTensor:
        return whole_tensor(spec, a + local if local != "input_layernorm.weight" else p + local,
                            f"model.layers.*.{tensor}", layer)

    def split(local: str, tensor: str) -> LocalTensor:
        ts = spec[f"model.layers.*.self_attn.{tensor}"]
        k, cols = ts.shape[1] // T, ts.shape[2]
        return LocalTensor(a + local, (k, cols), dt,
                           (Piece(ts.name, (spec.layer_pos(ts.name, layer), t * k, 0), (1, k, cols), (0, 0, 0)),))

    def down(local: str, tensor: str) -> LocalTensor:
        return split(local, tensor) if layout.local else whole(local, f"self_attn.{tensor}")

    out = [whole("input_layernorm.weight", "input_layernorm.weight")]
    if c.q_lora_rank:
        out += [down("linear_q_down_proj.weight", "q_a_proj.weight"),
                whole("linear_q_up_proj.layer_norm_weight", "self_attn.q_a_layernorm.weight"),
                split("linear_q_up_proj.weight", "q_b_proj.weight")]
    else:
        out.append(split("linear_q_proj.weight", "q_proj.weight"))
    out += [down("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
            whole("linear_kv_up_proj.layer_norm_weight", "self_attn.kv_a_layernorm.weight"),
            split("linear_kv_up_proj.weight", "kv_b_proj.weight")]
    o = spec["model.layers.*.self_attn.o_proj.weight"]
    cols = o.shape[2] // T
    out.append(LocalTensor(f"{a}linear_proj.weight", (c.hidden_size, cols), dt,
                           (Piece(o.name, (spec.layer_pos(o.name, layer), 0, t * cols), (1, c.hidden_size, cols),
                                  (0, 0, 0)),)))
    return out


def whole_tensor(spec: ModelSpec, local: str, tensor: str, layer: int) -> LocalTensor:
    """Layer ``layer`` of per-layer tensor ``tensor``, whole (a norm, a duplicated projection)."""
    ts = spec[tensor]
    inner = ts.shape[1:]
    return LocalTensor(local, inner, ts.dtype, (Piece(tensor, (spec.layer_pos(tensor, layer),) + (0,) * len(inner),
                                                      (1,) + inner, (0,) * len(ts.shape)),))


def in_held_dtype(spec: ModelSpec, lt: LocalTensor) -> LocalTensor:
    """``lt`` in the dtype its canonical tensors are held in: the config's, unless the spec says
    otherwise per tensor (a trainer holding float32 masters, whose plan casts on the way)."""
    dtypes = {spec[p.tensor].dtype for p in lt.pieces}
    return lt._replace(dtype=dtypes.pop()) if len(dtypes) == 1 else lt
