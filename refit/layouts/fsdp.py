"""FSDP2: every HF tensor a DTensor placed ``Shard(0)`` over a data-parallel mesh, under HF names.

``fsdp:dp<S>`` shards over S ranks; ``fsdp:dp<S>rep<R>`` is HSDP (``fully_shard`` on a 2-D mesh
``(replicate, shard)`` of R x S ranks, placements ``(Replicate(), Shard(0))``): R replica groups,
each sharded like ``fsdp:dp<S>``, global rank = replica * S + shard (the mesh in rank order).
Replicas hold equal tensors, so a plan reads each box from one of them, spreading the sends
over the groups (`refit.planners.p2p`).

``fused1``: the model holds each MoE layer's experts fused, as transformers 5 builds them
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]), so FSDP's ``Shard(0)`` splits
the expert dimension: a rank holds experts ``torch.chunk``'s rows of E, each whole, and none of
the others (the HF names stay per expert).

``tp<T>``: FSDP x TP, a 2-D mesh ``(dp, tp)`` in rank order (global rank = (replica * S + shard)
* T + tp rank), torch's tensor parallelism applied before ``fully_shard`` on the dp sub-mesh, with
the plan torchtitan gives a Llama-style model (`TP_DIMS`): ``ColwiseParallel`` on q/k/v, gate/up
and the LM head and ``RowwiseParallel`` on the embedding (both split dim 0: the DTensor is placed
``(_StridedShard(0), Shard(0))``, TP's chunk first, then FSDP's chunk of it), ``RowwiseParallel`` on
o_proj and down_proj (dim 1: ``(Shard(0), Shard(1))``), norms on the dp mesh alone.  Dense
models only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import ClassVar

from refit.errors import InvalidInput
from refit.layouts.base import LocalTensor, Piece
from refit.spec import ModelSpec


_EXPERT = re.compile(r".*\.experts\.(?P<e>\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# The tensor-parallel plan of ``tp<T>``: the dim TP splits of each HF tensor (others: none)
TP_DIMS: tuple[tuple[re.Pattern[str], int], ...] = (
    (re.compile(r".*\.self_attn\.(q|k|v)_proj\.(weight|bias)$"), 0),
    (re.compile(r".*\.mlp\.(gate|up)_proj\.weight$"), 0),
    (re.compile(r"^(model\.embed_tokens|lm_head)\.weight$"), 0),
    (re.compile(r".*\.(self_attn\.o_proj|mlp\.down_proj)\.weight$"), 1),
)


def tp_dim(name: str) -> int | None:
    """The dim ``tp<T>``'s plan splits HF tensor ``name`` on, or None (replicated over tp)."""
    return next((dim for pattern, dim in TP_DIMS if pattern.match(name)), None)


def chunk_rows(n: int, ranks: int, rank: int) -> tuple[int, int]:
    """``torch.chunk``'s split of ``n`` rows: ceil-sized chunks, the last ones short or empty."""
    size = -(-n // ranks)
    lo = min(n, rank * size)
    return lo, min(n, lo + size) - lo


@dataclass(frozen=True)
class FsdpLayout:
    """FSDP2: every HF tensor is a DTensor placed ``Shard(0)`` over a dp mesh (see the module)."""

    framework: ClassVar[str] = "fsdp"
    degrees: ClassVar[tuple[str, ...]] = ("dp", "rep", "tp", "fused")
    examples: ClassVar[tuple[str, ...]] = ("fsdp:dp8", "fsdp:dp4rep2", "fsdp:dp4tp2", "fsdp:dp8fused1")
    dp: int = 1  # ranks one replica group shards over
    rep: int = 1  # replica groups (HSDP)
    tp: int = 1  # tensor-parallel ranks (FSDP x TP)
    fused: int = 0  # 1: experts held fused per layer, sharded on the expert dimension

    @property
    def world_size(self) -> int:
        return self.dp * self.rep * self.tp

    def details(self) -> dict[str, int]:
        d = dict(dp=self.dp, rep=self.rep, world_size=self.world_size)
        return {**d, **({"tp": self.tp} if self.tp > 1 else {}), **({"fused": 1} if self.fused else {})}

    def describe(self) -> str:
        return (f"fsdp:dp{self.dp}" + (f"rep{self.rep}" if self.rep > 1 else "") + (f"tp{self.tp}" if self.tp > 1 else "")
                + ("fused1" if self.fused else ""))

    def coords(self, rank: int) -> tuple[int, int]:
        """(shard, tp rank) of global ``rank``."""
        return (rank // self.tp) % self.dp, rank % self.tp

    def replica_key(self, rank: int) -> tuple[int, ...]:
        return self.coords(rank)

    def experts_held(self, spec: ModelSpec, rank: int) -> range:
        """The experts whose rows ``rank`` holds of a fused expert parameter: ``torch.chunk``'s
        share of the expert dimension over the dp ranks."""
        lo, n = chunk_rows(spec.config.num_experts, self.dp, self.coords(rank)[0])
        return range(lo, lo + n)

    def resolve(self, spec: ModelSpec) -> "FsdpLayout":
        if self.dp < 1 or self.rep < 1 or self.tp < 1:
            raise InvalidInput(f"fsdp: dp, rep and tp must be at least 1, got dp {self.dp}, rep {self.rep}, tp {self.tp}")
        if self.fused not in (0, 1):
            raise InvalidInput(f"fsdp: fused is 1 (experts fused per layer) or absent, got fused{self.fused}")
        if self.fused and not spec.config.num_experts:
            raise InvalidInput(f"fsdp: {self.describe()} holds fused experts, but {spec.name} has none")
        if self.tp > 1 and spec.config.num_experts:
            raise InvalidInput(f"fsdp: {self.describe()}: FSDP x TP is described for dense models only, "
                               f"{spec.name} has {spec.config.num_experts} experts")
        return replace(self)

    def local_tensors(self, spec: ModelSpec, rank: int) -> list[LocalTensor]:
        out = []
        shard, tp_rank = self.coords(rank)
        experts = self.experts_held(spec, rank) if self.fused else None
        for t in spec.hf_tensors():
            box = [(0, n) for n in t.shape]  # (start, size) along each dim of the HF tensor
            expert = _EXPERT.match(t.name) if experts is not None else None
            dim = tp_dim(t.name) if self.tp > 1 else None
            if expert:  # a fused expert: wholly here or not at all
                if int(expert["e"]) not in experts:
                    box[0] = (0, 0)
            elif dim == 0:  # TP's chunk of the rows, then FSDP's chunk of that
                tlo, tn = chunk_rows(t.shape[0], self.tp, tp_rank)
                lo, n = chunk_rows(tn, self.dp, shard)
                box[0] = (tlo + lo, n)
            else:
                box[0] = chunk_rows(t.shape[0], self.dp, shard)
                if dim == 1:
                    box[1] = chunk_rows(t.shape[1], self.tp, tp_rank)
            shape = tuple(n for _, n in box)
            lead = len(t.start) - len(t.shape)  # canonical dims in front of the HF tensor's
            start = t.start[:lead] + tuple(s + lo for s, (lo, _) in zip(t.start[lead:], box))
            size = t.size[:lead] + shape
            pieces = (Piece(t.tensor, start, size, (0,) * len(t.start)),) if all(shape) else ()
            out.append(LocalTensor(t.name, shape, spec[t.tensor].dtype, pieces))
        return out
