"""Megatron-Core: how a GPTModel's parameters are split over ranks, and what they are called.

Conventions (checked against megatron-core 0.16.1 in tests/integration/test_megatron_conventions.py):

* Ranks are ordered ``tp-cp-ep-dp-pp`` (tp fastest).  Dense groups: rank = tp + T*(cp + C*(dp + D*pp)).
  Expert groups: rank = etp + Te*(ep + E*(edp + EDP*pp)) with etp*ep*edp = tp*cp*dp.
* ``embedding.word_embeddings.weight`` / ``output_layer.weight``: ``[Vp/T, H]``, vocab padded to
  a multiple of 128*T (``make_vocab_size_divisible_by``); first / last pipeline stage only.  A
  trainer that pads otherwise says so with the ``vocabdiv`` degree: a multiple of vocabdiv*T
  (``vocabdiv1``: unpadded but for tp's split, as mbridge / verl's Megatron bridge build it).  With
  tied embeddings the last stage keeps its own ``output_layer.weight`` copy only when pp > 1.
* ``linear_qkv``: rows interleaved per query group ``[q heads of g; k_g; v_g]``, split contiguously
  over TP (also when kv groups < tp: the cut then falls inside groups); ``linear_proj`` is o_proj
  split on dim 1.
* Experts (TE grouped-GEMM naming): ``mlp.experts.linear_fc1.weight{i}`` = [gate; up] rows of this
  etp shard, ``linear_fc2.weight{i}`` = down split on dim 1; local expert i on ep rank k is
  global expert k*E/EP + i.
* MLA (qk_layernorm): ``linear_q_down_proj`` / ``linear_kv_down_proj`` whole on every tp rank under
  the TE spec, split by rows over tp under the local spec (``local1``: ColumnParallelLinear); q_a/kv_a
  norms whole, fused as the up-projections' ``layer_norm_weight`` (TE) or ``q_layernorm`` /
  ``kv_layernorm`` (local); up-projections split by heads; no rope reordering against HF
  (tests/integration/test_megatron_mla.py).  Shared experts
  ``mlp.shared_experts.linear_fc{1,2}`` split over tp; ``mlp.router.expert_bias`` float32.
* Pipeline: model chunk c of pp rank p holds a run of consecutive layers; runs are laid out in
  virtual-stage order (c, p).  Local names restart at ``decoder.layers.0`` in every chunk, and
  chunks are prefixed ``chunk{c}.`` when vpp > 1.
* Multi-token prediction (a drafter spec of `refit.drafters`, ``mtp``): ``MultiTokenPredictionBlock``
  is built on the last pipeline stage only, so an MTP layout is that stage's grid (pp 1).  MTP layer
  i (HF layer N = num_hidden_layers + i) is ``mtp.layers.{i}.``: ``enorm`` / ``hnorm`` /
  ``final_layernorm`` (HF ``shared_head.norm``) whole on every rank, ``eh_proj`` a
  ColumnParallelLinear (2H -> H, ``gather_output=False``: rows split over tp; its input is
  (enorm(embedding), hnorm(hidden)) as HF's), and ``transformer_layer.`` a decoder layer named and
  split as ``decoder.layers.*``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

from refit.drafters import MTP, mtp_layers
from refit.errors import InvalidInput
from refit.layouts.base import LocalTensor, Piece, divides, pad_to, vocab_pieces
from refit.spec import ModelSpec

VOCAB_DIVISIBLE_BY = 128  # Megatron's --make-vocab-size-divisible-by default


@dataclass(frozen=True)
class MegatronLayout:
    framework: ClassVar[str] = "megatron"
    degrees: ClassVar[tuple[str, ...]] = ("tp", "pp", "vpp", "ep", "etp", "dp", "cp", "first", "last", "vocabdiv",
                                          "local")
    examples: ClassVar[tuple[str, ...]] = ("megatron:tp4ep8", "megatron:tp2pp2vpp2")
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int | None = None
    dp: int | None = None
    cp: int = 1
    first: int | None = None  # layers on the first pipeline stage (decoder_first_pipeline_num_layers)
    last: int | None = None  # layers on the last pipeline stage (decoder_last_pipeline_num_layers)
    vocabdiv: int = VOCAB_DIVISIBLE_BY  # the vocab is padded to a multiple of vocabdiv * tp
    # 1: built with Megatron-Core's local spec (no Transformer Engine), whose MLA down-projections are
    # ColumnParallelLinear, split over tp; 0: the TE spec's duplicated TELinear, whole on every rank.
    # Nothing else in refit's names and shapes differs (attach maps the local spec's names).
    local: int = 0

    # ------------------------------------------------------------------ degrees
    @property
    def etp_(self) -> int:
        # MoE recipes (and the DESIGN target tp4ep8 on 8 GPUs) use expert TP 1.  Megatron's own
        # argument default is etp = tp: write etp explicitly to get that.
        return self.etp if self.etp is not None else 1

    @property
    def dp_(self) -> int:
        if self.dp is not None:
            return self.dp
        # The smallest data-parallel size for which the expert grid fills the dense one.
        need = self.etp_ * self.ep
        return need // math.gcd(self.tp * self.cp, need)

    @property
    def edp(self) -> int:
        return self.tp * self.cp * self.dp_ // (self.etp_ * self.ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp_ * self.pp

    def details(self) -> dict[str, int]:
        d = dict(tp=self.tp, cp=self.cp, dp=self.dp_, pp=self.pp, vpp=self.vpp, ep=self.ep, etp=self.etp_,
                 edp=self.edp, world_size=self.world_size)
        if self.first is not None:
            d["first"] = self.first
        if self.last is not None:
            d["last"] = self.last
        if self.vocabdiv != VOCAB_DIVISIBLE_BY:
            d["vocabdiv"] = self.vocabdiv
        if self.local:
            d["local"] = self.local
        return d

    def describe(self) -> str:
        s = f"megatron:tp{self.tp}"
        for k in ("cp", "pp", "vpp", "ep"):
            if getattr(self, k) > 1:
                s += f"{k}{getattr(self, k)}"
        if self.ep > 1 or self.etp_ != 1:  # expert TP without EP too: tp1etp2 is not tp1
            s += f"etp{self.etp_}"
        s += f"dp{self.dp_}"
        if self.first is not None:
            s += f"first{self.first}"
        if self.last is not None:
            s += f"last{self.last}"
        if self.vocabdiv != VOCAB_DIVISIBLE_BY:
            s += f"vocabdiv{self.vocabdiv}"
        if self.local:
            s += f"local{self.local}"
        return s

    # ------------------------------------------------------------------ resolve + validate
    def resolve(self, spec: ModelSpec) -> "MegatronLayout":
        c = spec.config
        for k in ("tp", "pp", "vpp", "ep", "cp", "vocabdiv"):
            if getattr(self, k) < 1:
                raise InvalidInput(f"megatron: {k} must be at least 1, got {getattr(self, k)}")
        if (self.tp * self.cp * self.dp_) % (self.etp_ * self.ep):
            raise InvalidInput(
                f"megatron: tp*cp*dp ({self.tp}*{self.cp}*{self.dp_}={self.tp * self.cp * self.dp_}) is not "
                f"divisible by etp*ep ({self.etp_}*{self.ep}={self.etp_ * self.ep})"
            )
        divides("megatron: attention heads", c.num_heads, "tp", self.tp)
        if self.local not in (0, 1):
            raise InvalidInput(f"megatron: local is 1 (Megatron-Core's local spec) or 0 (Transformer Engine's), "
                               f"got {self.local}")
        if self.local and c.is_mla:  # the local spec's ColumnParallelLinear down-projections
            if c.q_lora_rank:
                divides("megatron: q_lora_rank (linear_q_down_proj rows, local spec)", c.q_lora_rank, "tp", self.tp)
            divides("megatron: kv_lora_rank + qk_rope_head_dim (linear_kv_down_proj rows, local spec)",
                    c.kv_lora_rank + c.qk_rope_head_dim, "tp", self.tp)
        if not c.is_mla:
            qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
            divides("megatron: linear_qkv rows ((heads + 2*kv heads) * head_dim)", qkv_rows, "tp", self.tp)
            G = c.num_kv_heads
            if G % self.tp and self.tp % G:  # TransformerConfig's own check (attention splits whole groups)
                raise InvalidInput(f"megatron: query groups (kv heads, {G}) must be a multiple or a divisor of "
                                 f"tp ({self.tp})")
        if c.num_shared_experts:
            divides("megatron: shared experts' intermediate size", c.shared_intermediate_size, "tp", self.tp)
        if c.dense_layers:
            divides("megatron: intermediate_size", c.intermediate_size, "tp", self.tp)
        if self.ep > 1 or self.etp is not None:
            if not c.is_moe:
                raise InvalidInput(f"megatron: ep{self.ep}/etp given but {spec.name} has no experts")
        if c.is_moe:
            divides("megatron: experts", c.num_experts, "ep", self.ep)
            divides("megatron: moe_intermediate_size", c.moe_intermediate_size, "etp", self.etp_)
        if self.vpp > 1 and self.pp == 1:
            raise InvalidInput("megatron: vpp > 1 needs pp > 1")
        if c.drafter:
            self._check_drafter(spec)
        resolved = replace(self, etp=self.etp_ if c.is_moe else self.etp, dp=self.dp_)
        return resolved._resolve_pipeline(c.num_layers)

    def _check_drafter(self, spec: ModelSpec) -> None:
        c = spec.config
        if c.drafter != MTP:
            raise InvalidInput(f"megatron: a {c.drafter} drafter is not a Megatron model; Megatron trains MTP layers "
                               f"(mtp.*)")
        if self.pp > 1:
            raise InvalidInput(f"megatron: MTP layers sit on the last pipeline stage only: their layout is that "
                               f"stage's grid, pp 1 (got pp {self.pp})")
        divides("megatron: eh_proj rows (hidden_size)", c.hidden_size, "tp", self.tp)

    def _resolve_pipeline(self, L: int) -> "MegatronLayout":
        P, V = self.pp, self.vpp
        if P == 1:
            if self.first is not None or self.last is not None:
                self.stage_layers(L)  # the one stage must then hold every layer (raises with the numbers)
            return self
        if self.first is None and self.last is None and L % (P * V):
            # Megatron's account_for_embedding/loss_in_pipeline_split: the embedding and the loss
            # each count as one layer, so the first and last stages build one layer fewer.
            if V == 1 and (L + 2) % P == 0:
                n = (L + 2) // P
                return replace(self, first=n - 1, last=n - 1)._resolve_pipeline(L)
            raise InvalidInput(
                f"megatron: layers ({L}) are not divisible by pp*vpp ({P}*{V}={P * V}); "
                f"give first<N>/last<N> (layers on the first/last pipeline stage)"
            )
        self.stage_layers(L)  # raises with the numbers if the split is impossible
        return self

    def stage_layers(self, L: int) -> dict[tuple[int, int], list[int]]:
        """(pp rank, model chunk) -> global layer ids, Megatron's uneven-pipeline rule included."""
        P, V = self.pp, self.vpp
        ends = [x for x in (self.first, self.last) if x is not None]
        middle_stages = P - len(ends)
        middle = L - sum(ends)
        if middle < 0 or middle_stages < 0 or (middle_stages == 0 and middle) or \
                (middle_stages and middle % (middle_stages * V)):
            raise InvalidInput(
                f"megatron: {L} layers cannot be split as first={self.first}, last={self.last} over "
                f"{middle_stages} middle stages x vpp {V}"
            )
        per_chunk = []
        for p in range(P):
            if p == 0 and self.first is not None:
                n = self.first
            elif p == P - 1 and self.last is not None:
                n = self.last
            else:
                n = middle // middle_stages
            divides(f"megatron: layers on pipeline stage {p}", n, "vpp", V)
            per_chunk.append(n // V)
        round_size = sum(per_chunk)
        out = {}
        for c in range(V):
            for p in range(P):
                lo = c * round_size + sum(per_chunk[:p])
                out[(p, c)] = list(range(lo, lo + per_chunk[p]))
        return out

    # ------------------------------------------------------------------ ranks
    def coords(self, rank: int) -> dict[str, int]:
        T, C, D = self.tp, self.cp, self.dp_
        Te, E = self.etp_, self.ep
        dense_rank = rank % (T * C * D)
        return dict(
            tp=rank % T, cp=(rank // T) % C, dp=(rank // (T * C)) % D, pp=rank // (T * C * D),
            etp=dense_rank % Te, ep=(dense_rank // Te) % E, edp=dense_rank // (Te * E),
        )

    def chunk_prefix(self, chunk: int) -> str:
        """What the local names of model chunk ``chunk`` start with (``chunk{c}.`` under a virtual pipeline)."""
        return f"chunk{chunk}." if self.vpp > 1 else ""

    def replica_key(self, rank: int) -> tuple[int, ...]:
        co = self.coords(rank)  # cp, dp and edp ranks hold copies
        return (co["tp"], co["pp"], co["ep"], co["etp"])

    # ------------------------------------------------------------------ tensors
    def local_tensors(self, spec: ModelSpec, rank: int) -> list[LocalTensor]:
        c = spec.config
        co = self.coords(rank)
        if c.drafter == MTP:
            return [_in_held_dtype(spec, lt) for lt in self._mtp(spec, co)]
        t, T = co["tp"], self.tp
        H, dt = c.hidden_size, c.dtype
        padded = pad_to(c.vocab_size, self.vocabdiv * T)
        stages = self.stage_layers(c.num_layers)
        out: list[LocalTensor] = []

        def add(name: str, shape: tuple[int, ...], *pieces: Piece) -> None:
            out.append(LocalTensor(prefix + name, shape, dt, tuple(pieces)))

        for chunk in range(self.vpp):
            prefix = self.chunk_prefix(chunk)
            first_stage = co["pp"] == 0 and chunk == 0
            last_stage = co["pp"] == self.pp - 1 and chunk == self.vpp - 1
            if first_stage:
                shape, pieces = vocab_pieces("model.embed_tokens.weight", c.vocab_size, H, padded, T, t)
                add("embedding.word_embeddings.weight", shape, *pieces)
            for j, layer in enumerate(stages[(co["pp"], chunk)]):
                lp = f"decoder.layers.{j}."
                out.extend(self._attention(spec, prefix + lp, layer, t))
                if layer in spec.config.moe_layers:
                    out.extend(self._moe(spec, prefix + lp, layer, co))
                else:
                    out.extend(self._dense_mlp(spec, prefix + lp, layer, t))
            if last_stage:
                add("decoder.final_layernorm.weight", (H,), Piece("model.norm.weight", (0,), (H,), (0,)))
                head = "model.embed_tokens.weight" if c.tie_embeddings else "lm_head.weight"
                if not c.tie_embeddings or self.pp > 1:
                    shape, pieces = vocab_pieces(head, c.vocab_size, H, padded, T, t)
                    add("output_layer.weight", shape, *pieces)
        return [_in_held_dtype(spec, lt) for lt in out]

    def _mtp(self, spec: ModelSpec, co: dict[str, int]) -> list[LocalTensor]:
        """The MTP layers of a drafter spec (every rank of the last stage holds all of them)."""
        c = spec.config
        t, H, dt = co["tp"], c.hidden_size, c.dtype
        rows = H // self.tp
        eh = "model.layers.*.eh_proj.weight"
        out: list[LocalTensor] = []
        for i, layer in enumerate(mtp_layers(c)):
            p = f"mtp.layers.{i}."
            out += [_whole(spec, p + "enorm.weight", "model.layers.*.enorm.weight", layer),
                    _whole(spec, p + "hnorm.weight", "model.layers.*.hnorm.weight", layer),
                    LocalTensor(p + "eh_proj.weight", (rows, 2 * H), dt,
                                (Piece(eh, (spec.layer_pos(eh, layer), t * rows, 0), (1, rows, 2 * H), (0, 0, 0)),))]
            out.extend(self._attention(spec, p + "transformer_layer.", layer, t))
            if layer in c.moe_layers:
                out.extend(self._moe(spec, p + "transformer_layer.", layer, co))
            else:
                out.extend(self._dense_mlp(spec, p + "transformer_layer.", layer, t))
            out.append(_whole(spec, p + "final_layernorm.weight", "model.layers.*.shared_head.norm.weight", layer))
        return out

    def _attention(self, spec: ModelSpec, p: str, layer: int, t: int) -> list[LocalTensor]:
        c = spec.config
        if c.is_mla:
            return self._mla(spec, p, layer, t)
        T, H, hd, dt = self.tp, c.hidden_size, c.head_dim, c.dtype
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
        out += [_whole(spec, f"{p}self_attention.{local}", f"model.layers.*.{hf}", layer) for local, hf in norms]
        o = "model.layers.*.self_attn.o_proj.weight"
        cols = c.num_heads * hd // T
        out.append(LocalTensor(f"{p}self_attention.linear_proj.weight", (H, cols), dt,
                               (Piece(o, (spec.layer_pos(o, layer), 0, t * cols), (1, H, cols), (0, 0, 0)),)))
        return out

    def _dense_mlp(self, spec: ModelSpec, p: str, layer: int, t: int, shared: bool = False) -> list[LocalTensor]:
        c = spec.config
        width, hf, mp = ((c.shared_intermediate_size, "mlp.shared_experts", "mlp.shared_experts") if shared
                         else (c.intermediate_size, "mlp", "mlp"))
        H, dt, n = c.hidden_size, c.dtype, width // self.tp
        gate, up, down = (f"model.layers.*.{hf}.{x}_proj.weight" for x in ("gate", "up", "down"))
        ln = "model.layers.*.post_attention_layernorm.weight"
        pos = spec.layer_pos(gate, layer)
        # a dense layer fuses the pre-MLP norm into linear_fc1; shared experts sit after pre_mlp_layernorm
        norm = [] if shared else [_whole(spec, f"{p}mlp.linear_fc1.layer_norm_weight", ln, layer)]
        return norm + [
            LocalTensor(f"{p}{mp}.linear_fc1.weight", (2 * n, H), dt,
                        (Piece(gate, (pos, t * n, 0), (1, n, H), (0, 0, 0)),
                         Piece(up, (pos, t * n, 0), (1, n, H), (0, n, 0)))),
            LocalTensor(f"{p}{mp}.linear_fc2.weight", (H, n), dt,
                        (Piece(down, (pos, 0, t * n), (1, H, n), (0, 0, 0)),)),
        ]

    def _moe(self, spec: ModelSpec, p: str, layer: int, co: dict[str, int]) -> list[LocalTensor]:
        c = spec.config
        H, dt, E = c.hidden_size, c.dtype, c.num_experts
        n = c.moe_intermediate_size // self.etp_
        lo = co["etp"] * n
        ln = "model.layers.*.post_attention_layernorm.weight"
        router = "model.layers.*.mlp.gate.weight"
        gate, up, down = (f"model.layers.*.mlp.experts.*.{x}_proj.weight" for x in ("gate", "up", "down"))
        pos = spec.layer_pos(gate, layer)
        out = [_whole(spec, f"{p}pre_mlp_layernorm.weight", ln, layer),
               _whole(spec, f"{p}mlp.router.weight", router, layer)]
        if c.router_bias:  # TopKRouter's expert_bias buffer (moe_router_enable_expert_bias), float32 in the spec
            bias = "model.layers.*.mlp.gate.e_score_correction_bias"
            out.append(_whole(spec, f"{p}mlp.router.expert_bias", bias, layer))
        if c.num_shared_experts:  # SharedExpertMLP: an MLP split over tp (not etp)
            out.extend(self._dense_mlp(spec, p, layer, co["tp"], shared=True))
        per_rank = E // self.ep
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

    def _mla(self, spec: ModelSpec, p: str, layer: int, t: int) -> list[LocalTensor]:
        """MLASelfAttention with qk_layernorm (as DeepSeek-V3 recipes run it).  Under the
        Transformer Engine spec the down-projections are TELinear ``duplicated`` (whole on every tp
        rank); under the local spec (``local``) ColumnParallelLinear, their rows split contiguously
        over tp (the attention gathers their outputs before the q_a/kv_a norms).  The norms are
        whole either way (TE fuses them into the up-projections as ``layer_norm_weight``; attach
        maps the local spec's ``q_layernorm`` / ``kv_layernorm`` to those names); the
        up-projections are split by heads (contiguous rows), linear_proj on dim 1."""
        c = spec.config
        T, dt = self.tp, c.dtype
        a = f"{p}self_attention."

        def whole(local: str, tensor: str) -> LocalTensor:
            return _whole(spec, a + local if local != "input_layernorm.weight" else p + local,
                          f"model.layers.*.{tensor}", layer)

        def split(local: str, tensor: str) -> LocalTensor:
            ts = spec[f"model.layers.*.self_attn.{tensor}"]
            k, cols = ts.shape[1] // T, ts.shape[2]
            return LocalTensor(a + local, (k, cols), dt,
                               (Piece(ts.name, (spec.layer_pos(ts.name, layer), t * k, 0), (1, k, cols), (0, 0, 0)),))

        def down(local: str, tensor: str) -> LocalTensor:
            return split(local, tensor) if self.local else whole(local, f"self_attn.{tensor}")

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


def _whole(spec: ModelSpec, local: str, tensor: str, layer: int) -> LocalTensor:
    """Layer ``layer`` of per-layer tensor ``tensor``, whole (a norm, a duplicated projection)."""
    ts = spec[tensor]
    inner = ts.shape[1:]
    return LocalTensor(local, inner, ts.dtype, (Piece(tensor, (spec.layer_pos(tensor, layer),) + (0,) * len(inner),
                                                      (1,) + inner, (0,) * len(ts.shape)),))


def _in_held_dtype(spec: ModelSpec, lt: LocalTensor) -> LocalTensor:
    """``lt`` in the dtype its canonical tensors are held in: the config's, unless the spec says
    otherwise per tensor (a trainer holding float32 masters, whose plan casts on the way)."""
    dtypes = {spec[p.tensor].dtype for p in lt.pieces}
    return lt._replace(dtype=dtypes.pop()) if len(dtypes) == 1 else lt
