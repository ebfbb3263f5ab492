"""FSDP2: every HF tensor a DTensor placed ``Shard(0)`` over a data-parallel mesh, under HF names."""

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
    degrees: ClassVar[tuple[str, ...]] = ("dp",)
    examples: ClassVar[tuple[str, ...]] = ()
    dp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp

    def details(self) -> dict[str, int]:
        return dict(dp=self.dp, world_size=self.dp)

    def describe(self) -> str:
        return f"fsdp:dp{self.dp}"

    def replica_key(self, rank: int) -> tuple[int, ...]:
        return (rank,)

    def resolve(self, spec: ModelSpec) -> "FsdpLayout":
        if self.dp < 1:
            raise InvalidInput(f"fsdp: dp must be at least 1, got {self.dp}")
        return replace(self)

    def local_tensors(self, spec: ModelSpec, rank: int) -> list[LocalTensor]:
        out = []
        for t in spec.hf_tensors():
            lo, n = chunk_rows(t.shape[0], self.dp, rank)
            shape = (n,) + t.shape[1:]
            lead = len(t.start) - len(t.shape)  # canonical dims in front of the HF tensor's
            start = t.start[:lead] + (t.start[lead] + lo,) + t.start[lead + 1:]
            size = t.size[:lead] + (n,) + t.size[lead + 1:]
            pieces = (Piece(t.tensor, start, size, (0,) * len(t.start)),) if n else ()
            out.append(LocalTensor(t.name, shape, spec[t.tensor].dtype, pieces))
        return out
