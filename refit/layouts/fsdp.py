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
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import ClassVar

from refit.errors import InvalidInput
from refit.layouts.base import LocalTensor, Piece
from refit.spec import ModelSpec


_EXPERT = re.compile(r".*\.experts\.(?P<e>\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def chunk_rows(n: int, ranks: int, rank: int) -> tuple[int, int]:
    """``torch.chunk``'s split of ``n`` rows: ceil-sized chunks, the last ones short or empty."""
    size = -(-n // ranks)
    lo = min(n, rank * size)
    return lo, min(n, lo + size) - lo


@dataclass(frozen=True)
class FsdpLayout:
    """FSDP2: every HF tensor is a DTensor placed ``Shard(0)`` over a dp mesh."""

    framework: ClassVar[str] = "fsdp"
    degrees: ClassVar[tuple[str, ...]] = ("dp", "rep", "fused")
    examples: ClassVar[tuple[str, ...]] = ("fsdp:dp8", "fsdp:dp4rep2", "fsdp:dp8fused1")
    dp: int = 1  # ranks one replica group shards over
    rep: int = 1  # replica groups (HSDP)
    fused: int = 0  # 1: experts held fused per layer, sharded on the expert dimension

    @property
    def world_size(self) -> int:
        return self.dp * self.rep

    def details(self) -> dict[str, int]:
        return dict(dp=self.dp, rep=self.rep, world_size=self.world_size, **({"fused": 1} if self.fused else {}))

    def describe(self) -> str:
        return f"fsdp:dp{self.dp}" + (f"rep{self.rep}" if self.rep > 1 else "") + ("fused1" if self.fused else "")

    def replica_key(self, rank: int) -> tuple[int, ...]:
        return (rank % self.dp,)

    def resolve(self, spec: ModelSpec) -> "FsdpLayout":
        if self.dp < 1 or self.rep < 1:
            raise InvalidInput(f"fsdp: dp and rep must be at least 1, got dp {self.dp}, rep {self.rep}")
        if self.fused not in (0, 1):
            raise InvalidInput(f"fsdp: fused is 1 (experts fused per layer) or absent, got fused{self.fused}")
        if self.fused and not spec.config.num_experts:
            raise InvalidInput(f"fsdp: {self.describe()} holds fused experts, but {spec.name} has none")
        return replace(self)

    def local_tensors(self, spec: ModelSpec, rank: int) -> list[LocalTensor]:
        out = []
        shard = rank % self.dp
        experts = chunk_rows(spec.config.num_experts, self.dp, shard) if self.fused else None
        for t in spec.hf_tensors():
            expert = _EXPERT.match(t.name) if experts else None
            if expert:  # a fused expert: wholly here or not at all
                lo, count = experts
                held = lo <= int(expert["e"]) < lo + count
                lo, n = 0, t.shape[0] if held else 0
            else:
                lo, n = chunk_rows(t.shape[0], self.dp, shard)
            shape = (n,) + t.shape[1:]
            lead = len(t.start) - len(t.shape)  # canonical dims in front of the HF tensor's
            start = t.start[:lead] + (t.start[lead] + lo,) + t.start[lead + 1:]
            size = t.size[:lead] + (n,) + t.size[lead + 1:]
            pieces = (Piece(t.tensor, start, size, (0,) * len(t.start)),) if n else ()
            out.append(LocalTensor(t.name, shape, spec[t.tensor].dtype, pieces))
        return out
