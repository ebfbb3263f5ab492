"""FSDP2: every HF tensor a DTensor placed ``Shard(0)`` over a data-parallel mesh, under HF names.

``fsdp:dp<S>`` shards over S ranks; ``fsdp:dp<S>rep<R>`` is HSDP (``fully_shard`` on a 2-D mesh
``(replicate, shard)`` of R x S ranks, placements ``(Replicate(), Shard(0))``): R replica groups,
each sharded like ``fsdp:dp<S>``, global rank = replica * S + shard (the mesh in rank order).
Replicas hold equal tensors, so a plan reads each box from one of them, spreading the sends
over the groups (`refit.planners.p2p`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from refit.errors import InvalidInput
from refit.layouts.base import LocalTensor, Piece
from refit.spec import ModelSpec


def chunk_rows(n: int, ranks: int, rank: int) -> tuple[int, int]:
    """``torch.chunk``'s split of ``n`` rows: ceil-sized chunks, the last ones short or empty."""
    size = -(-n // ranks)
    lo = min(n, rank * size)
    return lo, min(n, lo + size) - lo


@dataclass(frozen=True)
class FsdpLayout:
    """FSDP2: every HF tensor is a DTensor placed ``Shard(0)`` over a dp mesh."""

    framework: ClassVar[str] = "fsdp"
    degrees: ClassVar[tuple[str, ...]] = ("dp", "rep")
    examples: ClassVar[tuple[str, ...]] = ("fsdp:dp8", "fsdp:dp4rep2")
    dp: int = 1  # ranks one replica group shards over
    rep: int = 1  # replica groups (HSDP)

    @property
    def world_size(self) -> int:
        return self.dp * self.rep

    def details(self) -> dict[str, int]:
        return dict(dp=self.dp, rep=self.rep, world_size=self.world_size)

    def describe(self) -> str:
        return f"fsdp:dp{self.dp}" + (f"rep{self.rep}" if self.rep > 1 else "")

    def replica_key(self, rank: int) -> tuple[int, ...]:
        return (rank % self.dp,)

    def resolve(self, spec: ModelSpec) -> "FsdpLayout":
        if self.dp < 1 or self.rep < 1:
            raise InvalidInput(f"fsdp: dp and rep must be at least 1, got dp {self.dp}, rep {self.rep}")
        return replace(self)

    def local_tensors(self, spec: ModelSpec, rank: int) -> list[LocalTensor]:
        out = []
        shard = rank % self.dp
        for t in spec.hf_tensors():
            lo, n = chunk_rows(t.shape[0], self.dp, shard)
            shape = (n,) + t.shape[1:]
            lead = len(t.start) - len(t.shape)  # canonical dims in front of the HF tensor's
            start = t.start[:lead] + (t.start[lead] + lo,) + t.start[lead + 1:]
            size = t.size[:lead] + (n,) + t.size[lead + 1:]
            pieces = (Piece(t.tensor, start, size, (0,) * len(t.start)),) if n else ()
            out.append(LocalTensor(t.name, shape, spec[t.tensor].dtype, pieces))
        return out
