"""vLLM: the parameters each worker of an engine holds, as its weight loaders fill them.

Conventions (checked against vllm 0.32's own loaders in tests/integration/test_vllm_conventions.py):

* Global rank = dp_rank * tp + tp_rank.  Every dp replica holds the attention/dense weights.
* ``qkv_proj`` = [q heads of this rank; k; v].  With fewer kv heads than tp each kv head is
  replicated on tp/kv ranks (rank r holds kv head r // (tp/kv)).  ``o_proj`` is split on dim 1.
* ``gate_up_proj`` / ``w13_weight`` = [gate; up] of this rank's shard.  vLLM 0.32 keeps experts
  under ``mlp.experts.routed_experts.`` (older releases: ``mlp.experts.``).
* MoE without expert parallel: experts are tensor-split over the *flattened* dp*tp group
  (rank dp*tp + t), ``w13_weight`` [E, 2I/(dp*tp), H], ``w2_weight`` [E, H, I/(dp*tp)].
  With expert parallel the EP group is the same dp*tp ranks; experts are placed linearly, the first
  E % ep ranks getting one more, and are not split inside.
* DeepSeek-V3 MLA: with q LoRA, ``fused_qkv_a_proj`` = [q_a_proj; kv_a_proj_with_mqa], replicated;
  without, ``kv_a_proj_with_mqa`` replicated and ``q_proj`` split by heads; ``q_b_proj`` and
  ``kv_b_proj`` split by heads (contiguous rows).  Shared experts: an MLP split over tp only, but
  whole on every rank when vLLM runs the MoE sequence parallel (`replicated_shared_experts`).
  ``e_score_correction_bias`` stays float32.
* GLM-4.5: vLLM holds ``mlp.gate.weight`` in float32, upcast by its loader from the checkpoint's
  dtype.  This layout declares what the loader is fed (the checkpoint dtype); the vLLM backend's
  landing widens it exactly into the live parameter.
* ``embed_tokens`` / ``lm_head``: vocab padded to a multiple of 64, split evenly over tp;
  a tied ``lm_head`` is the embedding itself and does not appear among the parameters.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import ClassVar

from refit.archs import DEEPSEEK_ARCHS
from refit.errors import InvalidInput
from refit.layouts.base import LocalTensor, Piece, divides, pad_to, vocab_pieces
from refit.layouts.vllm_draft import drafter_local_tensors, drafter_varying_tensors
from refit.layouts.vllm_lora import lora_local_tensors
from refit.spec import ModelSpec

VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


@functools.lru_cache(maxsize=256)
def _tp_rank_layers(layout: "VllmLayout", spec: ModelSpec, t: int) -> tuple:
    """Every layer's dp-independent tensors of tp rank ``t`` (see `VllmLayout._layer_parts`),
    built once and shared by the dp ranks: an MoE engine's ranks all differ (their experts), and
    building 256 ranks x 61 layers of identical attention tensors was most of a 1T plan's layout time."""
    return tuple(layout._layer_parts(spec, layer, t) for layer in range(spec.config.num_layers))


def clear_caches() -> None:
    """Forget built layer tensors (for cold planning-time measurements)."""
    _tp_rank_layers.cache_clear()


def expert_range(num_experts: int, ep: int, ep_rank: int) -> tuple[int, int]:
    """vLLM's linear expert placement: (first global expert, count) of one EP rank."""
    base, extra = divmod(num_experts, ep)
    count = base + (1 if ep_rank < extra else 0)
    return ep_rank * base + min(ep_rank, extra), count


def replicated_shared_experts(arch: str, tp: int, dp: int, expert_parallel: bool) -> bool:
    """vLLM's DeepseekV2MoE builds its shared experts with ``disable_tp`` (whole on every rank)
    when ``ParallelConfig.use_sequence_parallel_moe`` holds: expert parallel with tp > 1 and dp > 1
    under the default all2all backend (allgather_reducescatter; the DeepEP/MoRI/NIXL ones too).
    GLM-4.5's Glm4MoE always splits them over tp."""
    return arch in DEEPSEEK_ARCHS and expert_parallel and tp > 1 and dp > 1


@dataclass(frozen=True)
class VllmLayout:
    framework: ClassVar[str] = "vllm"
    degrees: ClassVar[tuple[str, ...]] = ("tp", "ep", "dp")
    examples: ClassVar[tuple[str, ...]] = ("vllm:tp8", "vllm:tp4ep4", "vllm:tp8dp4")
    tp: int = 1
    dp: int | None = None
    ep: int | None = None  # None: expert parallel off; else the EP size, which vLLM fixes to tp*dp
    _moe_model: bool = field(default=True, compare=False, repr=False)  # set by resolve()

    @property
    def dp_(self) -> int:
        if self.dp is not None:
            return self.dp
        if self.ep is not None and self.ep % self.tp == 0:
            return self.ep // self.tp
        return 1

    @property
    def world_size(self) -> int:
        return self.tp * self.dp_

    @property
    def expert_parallel(self) -> bool:
        return self.ep is not None

    def details(self) -> dict[str, int]:
        return dict(tp=self.tp, dp=self.dp_, ep=self.ep or 1, world_size=self.world_size)

    def describe(self) -> str:
        s = f"vllm:tp{self.tp}"
        if self.ep is not None:
            s += f"ep{self.ep}"
        if self.dp_ > 1:
            s += f"dp{self.dp_}"
        return s

    def resolve(self, spec: ModelSpec) -> "VllmLayout":
        c = spec.config
        if self.tp < 1 or self.dp_ < 1:
            raise InvalidInput(f"vllm: tp and dp must be at least 1, got tp{self.tp} dp{self.dp_}")
        if self.ep is not None and self.ep != self.tp * self.dp_:
            raise InvalidInput(
                f"vllm: the expert-parallel size is tp*dp ({self.tp}*{self.dp_}={self.tp * self.dp_}); "
                f"ep{self.ep} cannot be served"
            )
        if self.ep is not None and not c.is_moe:
            raise InvalidInput(f"vllm: ep{self.ep} given but {spec.name} has no experts")
        divides("vllm: attention heads", c.num_heads, "tp", self.tp)
        if c.num_shared_experts and not replicated_shared_experts(c.arch, self.tp, self.dp_, self.expert_parallel):
            divides("vllm: shared experts' intermediate size", c.shared_intermediate_size, "tp", self.tp)
        if c.arch == "qwen2" and c.head_dim * c.num_heads != c.hidden_size:
            # vLLM's Qwen2Attention ignores config.head_dim and would load narrowed q/k/v silently.
            raise InvalidInput(f"vllm: qwen2 with head_dim {c.head_dim} != hidden_size/heads "
                             f"({c.hidden_size}/{c.num_heads}) is loaded wrongly by vLLM")
        divides(f"vllm: vocab padded to a multiple of {VOCAB_PADDING}", pad_to(c.vocab_size, VOCAB_PADDING), "tp",
                self.tp)
        if c.is_mla:
            pass  # MLA: q/kv up-projections and o_proj split by heads; the down-projections replicated
        elif c.num_kv_heads >= self.tp:
            divides("vllm: kv heads", c.num_kv_heads, "tp", self.tp)
        else:
            divides("vllm: tp", self.tp, "kv heads (replicated when fewer than tp)", c.num_kv_heads)
        if c.dense_layers:
            divides("vllm: intermediate_size", c.intermediate_size, "tp", self.tp)
        if c.is_moe and self.ep is None:
            divides("vllm: moe_intermediate_size", c.moe_intermediate_size, "tp*dp (experts are split over the "
                    "flattened dp x tp group without expert parallel)", self.tp * self.dp_)
        if c.is_moe and self.ep is not None and c.num_experts < self.ep:
            raise InvalidInput(f"vllm: {c.num_experts} experts cannot fill ep{self.ep}")
        return replace(self, dp=self.dp_, _moe_model=c.is_moe)

    def replicas(self) -> tuple[int, int] | None:
        """(ranks per replica, replicas) when each dp replica holds a whole copy of the model (a
        dense model: rank ``r`` holds what rank ``r % tp`` holds), else None (MoE experts are split
        over every rank).  Such replicas come and go on their own (`refit.control.membership`)."""
        return None if self._moe_model else (self.tp, self.dp_)

    def with_replicas(self, n: int) -> "VllmLayout":
        """This layout with ``n`` dp replicas (to be resolved again)."""
        return replace(self, dp=n)

    def replica_key(self, rank: int) -> tuple[int, ...]:
        # dp replicas share attention and dense weights, but MoE experts differ on every rank
        return (rank,) if self._moe_model else (rank % self.tp,)

    def varying_key(self, rank: int) -> tuple[int, ...] | None:
        """The dp ranks of one tp rank differ only in their routed experts (`varying_tensors`;
        see `refit.layouts.base.all_holdings`)."""
        return (rank % self.tp,) if self._moe_model else None

    def varying_tensors(self, spec: ModelSpec, rank: int) -> list[LocalTensor]:
        if spec.config.drafter:  # MTP layers / an EAGLE head (refit/layouts/vllm_draft.py)
            return drafter_varying_tensors(self, spec, rank)
        return [lt for layer in spec.config.moe_layers
                for lt in self._routed_experts(spec, f"model.layers.{layer}.", layer, rank)]

    def local_tensors(self, spec: ModelSpec, rank: int) -> list[LocalTensor]:
        c = spec.config
        if c.lora is not None:  # one LoRA adapter: the engine's LoRA slots (refit/layouts/vllm_lora.py)
            return lora_local_tensors(self, spec, rank)
        if c.drafter:  # a speculative engine's MTP or EAGLE drafter (refit/layouts/vllm_draft.py)
            return drafter_local_tensors(self, spec, rank)
        T = self.tp
        t = rank % T
        H, dt = c.hidden_size, c.dtype
        padded = pad_to(c.vocab_size, VOCAB_PADDING)
        out: list[LocalTensor] = []
        shape, pieces = vocab_pieces("model.embed_tokens.weight", c.vocab_size, H, padded, T, t)
        out.append(LocalTensor("model.embed_tokens.weight", shape, dt, pieces))
        for layer, (head, tail) in enumerate(_tp_rank_layers(self, spec, t)):
            out.extend(head)
            if layer in c.moe_layers:
                out.extend(self._routed_experts(spec, f"model.layers.{layer}.", layer, rank))
            out.extend(tail)
        out.append(LocalTensor("model.norm.weight", (H,), dt, (Piece("model.norm.weight", (0,), (H,), (0,)),)))
        if not c.tie_embeddings:
            shape, pieces = vocab_pieces("lm_head.weight", c.vocab_size, H, padded, T, t)
            out.append(LocalTensor("lm_head.weight", shape, dt, pieces))
        return out

    def _layer_parts(self, spec: ModelSpec, layer: int, t: int) -> tuple[tuple[LocalTensor, ...], tuple[LocalTensor, ...]]:
        """A layer's tensors on tp rank ``t`` that do not depend on the dp rank: those before the
        routed experts (attention, dense MLP or router + shared experts) and those after (norms)."""
        c = spec.config
        H, hd, dt, T = c.hidden_size, c.head_dim, c.dtype, self.tp
        p = f"model.layers.{layer}."

        def whole(local: str, tensor: str, n: int) -> LocalTensor:
            pos = spec.layer_pos(tensor, layer)
            return LocalTensor(p + local, (n,), dt, (Piece(tensor, (pos, 0), (1, n), (0, 0)),))

        head = self._mla(spec, p, layer, t) if c.is_mla else self._qkv(spec, p, layer, t)
        o = "model.layers.*.self_attn.o_proj.weight"
        cols = spec[o].shape[2] // T
        head.append(LocalTensor(p + "self_attn.o_proj.weight", (H, cols), dt,
                                (Piece(o, (spec.layer_pos(o, layer), 0, t * cols), (1, H, cols), (0, 0, 0)),)))
        if c.qk_norm:
            head.append(whole("self_attn.q_norm.weight", "model.layers.*.self_attn.q_norm.weight", hd))
            head.append(whole("self_attn.k_norm.weight", "model.layers.*.self_attn.k_norm.weight", hd))
        head.extend(self._moe(spec, p, layer, t) if layer in c.moe_layers else self._dense_mlp(spec, p, layer, t))
        tail = (whole("input_layernorm.weight", "model.layers.*.input_layernorm.weight", H),
                whole("post_attention_layernorm.weight", "model.layers.*.post_attention_layernorm.weight", H))
        return tuple(head), tail

    def _qkv(self, spec: ModelSpec, p: str, layer: int, t: int) -> list[LocalTensor]:
        c = spec.config
        T, H, hd, dt = self.tp, c.hidden_size, c.head_dim, c.dtype
        q_n = c.num_heads // T * hd
        if c.num_kv_heads >= T:
            kv_lo, kv_n = t * (c.num_kv_heads // T) * hd, c.num_kv_heads // T * hd
        else:
            kv_lo, kv_n = (t // (T // c.num_kv_heads)) * hd, hd
        parts = (("q", t * q_n, q_n), ("k", kv_lo, kv_n), ("v", kv_lo, kv_n))
        out = []
        for kind in ("weight", "bias") if c.qkv_bias else ("weight",):
            pieces, row = [], 0
            for proj, lo, n in parts:
                tensor = f"model.layers.*.self_attn.{proj}_proj.{kind}"
                pos = spec.layer_pos(tensor, layer)
                if kind == "weight":
                    pieces.append(Piece(tensor, (pos, lo, 0), (1, n, H), (0, row, 0)))
                else:
                    pieces.append(Piece(tensor, (pos, lo), (1, n), (0, row)))
                row += n
            shape = (row, H) if kind == "weight" else (row,)
            out.append(LocalTensor(f"{p}self_attn.qkv_proj.{kind}", shape, dt, tuple(pieces)))
        return out

    def _dense_mlp(self, spec: ModelSpec, p: str, layer: int, t: int, shared: bool = False,
                   ways: int | None = None) -> list[LocalTensor]:
        """A gated MLP split ``ways`` ways (tp unless given), of which rank ``t`` holds one."""
        c = spec.config
        width, mlp = (c.shared_intermediate_size, "mlp.shared_experts") if shared else (c.intermediate_size, "mlp")
        H, dt, n = c.hidden_size, c.dtype, width // (ways or self.tp)
        gate, up, down = (f"model.layers.*.{mlp}.{x}_proj.weight" for x in ("gate", "up", "down"))
        pos = spec.layer_pos(gate, layer)
        p += mlp + "."
        return [
            LocalTensor(f"{p}gate_up_proj.weight", (2 * n, H), dt,
                        (Piece(gate, (pos, t * n, 0), (1, n, H), (0, 0, 0)),
                         Piece(up, (pos, t * n, 0), (1, n, H), (0, n, 0)))),
            LocalTensor(f"{p}down_proj.weight", (H, n), dt, (Piece(down, (pos, 0, t * n), (1, H, n), (0, 0, 0)),)),
        ]

    def _moe(self, spec: ModelSpec, p: str, layer: int, t: int) -> list[LocalTensor]:
        """Router, its bias and the shared experts (the same on every dp rank of tp rank ``t``)."""
        c = spec.config
        H, dt, E = c.hidden_size, c.dtype, c.num_experts
        router = "model.layers.*.mlp.gate.weight"
        out = [LocalTensor(f"{p}mlp.gate.weight", (E, H), dt,
                           (Piece(router, (spec.layer_pos(router, layer), 0, 0), (1, E, H), (0, 0, 0)),))]
        if c.router_bias:  # float32 in the checkpoint and in vLLM
            bias = "model.layers.*.mlp.gate.e_score_correction_bias"
            out.append(LocalTensor(f"{p}mlp.gate.e_score_correction_bias", (E,), "float32",
                                   (Piece(bias, (spec.layer_pos(bias, layer), 0), (1, E), (0, 0)),)))
        if c.num_shared_experts:  # an ordinary MLP, split over tp only (dp replicas hold copies) or whole
            if replicated_shared_experts(c.arch, self.tp, self.dp_, self.expert_parallel):
                out.extend(self._dense_mlp(spec, p, layer, 0, shared=True, ways=1))
            else:
                out.extend(self._dense_mlp(spec, p, layer, t, shared=True))
        return out

    def _routed_experts(self, spec: ModelSpec, p: str, layer: int, rank: int) -> list[LocalTensor]:
        c = spec.config
        H, dt, E, I = c.hidden_size, c.dtype, c.num_experts, c.moe_intermediate_size
        gate, up, down = (f"model.layers.*.mlp.experts.*.{x}_proj.weight" for x in ("gate", "up", "down"))
        pos = spec.layer_pos(gate, layer)
        if self.expert_parallel:
            e0, ne = expert_range(E, self.tp * self.dp_, rank)
            i0, n = 0, I
        else:
            e0, ne = 0, E
            n = I // (self.tp * self.dp_)
            i0 = rank * n  # flattened dp x tp rank == global rank
        return [
            LocalTensor(f"{p}mlp.experts.routed_experts.w13_weight", (ne, 2 * n, H), dt, (
                Piece(gate, (pos, e0, i0, 0), (1, ne, n, H), (0, 0, 0, 0)),
                Piece(up, (pos, e0, i0, 0), (1, ne, n, H), (0, 0, n, 0)))),
            LocalTensor(f"{p}mlp.experts.routed_experts.w2_weight", (ne, H, n), dt,
                        (Piece(down, (pos, e0, 0, i0), (1, ne, H, n), (0, 0, 0, 0)),)),
        ]

    def _mla(self, spec: ModelSpec, p: str, layer: int, t: int) -> list[LocalTensor]:
        """DeepseekV2MLAAttention's parameters, in its order.  The down-projections are replicated
        (with q LoRA, q_a_proj and kv_a_proj_with_mqa are fused row-wise into ``fused_qkv_a_proj``);
        q_b_proj / q_proj and kv_b_proj are split by heads (contiguous rows) over tp."""
        c = spec.config
        T, H, dt = self.tp, c.hidden_size, c.dtype
        n = f"{p}self_attn."
        out: list[LocalTensor] = []

        def rows(local: str, tensor: str, lo: int, count: int, at: int = 0) -> Piece:
            ts = spec[f"model.layers.*.self_attn.{tensor}"]
            return Piece(ts.name, (spec.layer_pos(ts.name, layer), lo, 0), (1, count, ts.shape[2]), (0, at, 0))

        def norm(local: str, tensor: str, size: int) -> LocalTensor:
            name = f"model.layers.*.self_attn.{tensor}"
            return LocalTensor(n + local, (size,), dt, (Piece(name, (spec.layer_pos(name, layer), 0), (1, size), (0, 0)),))

        def split(local: str, tensor: str) -> LocalTensor:
            full, cols = spec[f"model.layers.*.self_attn.{tensor}"].shape[1:]
            k = full // T
            return LocalTensor(n + local, (k, cols), dt, (rows(local, tensor, t * k, k),))

        kv_a = c.kv_lora_rank + c.qk_rope_head_dim
        if c.q_lora_rank:
            qa = c.q_lora_rank
            out.append(LocalTensor(n + "fused_qkv_a_proj.weight", (qa + kv_a, H), dt, (
                rows("", "q_a_proj.weight", 0, qa), rows("", "kv_a_proj_with_mqa.weight", 0, kv_a, qa))))
            out.append(norm("q_a_layernorm.weight", "q_a_layernorm.weight", qa))
            out.append(split("q_b_proj.weight", "q_b_proj.weight"))
        else:
            out.append(LocalTensor(n + "kv_a_proj_with_mqa.weight", (kv_a, H), dt,
                                   (rows("", "kv_a_proj_with_mqa.weight", 0, kv_a),)))
            out.append(split("q_proj.weight", "q_proj.weight"))
        out.append(norm("kv_a_layernorm.weight", "kv_a_layernorm.weight", c.kv_lora_rank))
        out.append(split("kv_b_proj.weight", "kv_b_proj.weight"))
        return out
