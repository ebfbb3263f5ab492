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

This module holds the layout (degrees, validation, pipeline split, rank coordinates) and walks a
rank's chunks; the tensors of each layer are built in `refit.layouts.megatron_tensors`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

from refit.drafters import MTP
from refit.errors import InvalidInput
from refit.layouts.base import LocalTensor, Piece, divides, pad_to, vocab_pieces
from refit.layouts.megatron_tensors import (attention_tensors, dense_mlp_tensors, in_held_dtype, moe_tensors,
                                            mtp_tensors)
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
    # The chunks, embedding and head are walked here; each layer's tensors come from refit.layouts.megatron_tensors.
    def local_tensors(self, spec: ModelSpec, rank: int) -> list[LocalTensor]:
        c = spec.config
        co = self.coords(rank)
        if c.drafter == MTP:
            return [in_held_dtype(spec, lt) for lt in mtp_tensors(self, spec, co)]
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
                out.extend(attention_tensors(self, spec, prefix + lp, layer, t))
                if layer in spec.config.moe_layers:
                    out.extend(moe_tensors(self, spec, prefix + lp, layer, co))
                else:
                    out.extend(dense_mlp_tensors(self, spec, prefix + lp, layer, t))
            if last_stage:
                add("decoder.final_layernorm.weight", (H,), Piece("model.norm.weight", (0,), (H,), (0,)))
                head = "model.embed_tokens.weight" if c.tie_embeddings else "lm_head.weight"
                if not c.tie_embeddings or self.pp > 1:
                    shape, pieces = vocab_pieces(head, c.vocab_size, H, padded, T, t)
                    add("output_layer.weight", shape, *pieces)
        return [in_held_dtype(spec, lt) for lt in out]
