"""The layout of a plain Hugging Face checkpoint: one rank, every tensor whole, under HF names.

(Reading such a checkpoint from disk is `refit.hf_checkpoint`; FSDP2 is `refit.layouts.fsdp`.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from refit.layouts.base import LocalTensor, Piece
from refit.spec import ModelSpec


@dataclass(frozen=True)
class HFLayout:
    """One rank holding every tensor of an ordinary HF checkpoint, in full."""

    framework: ClassVar[str] = "hf"
    degrees: ClassVar[tuple[str, ...]] = ()
    examples: ClassVar[tuple[str, ...]] = ()

    @property
    def world_size(self) -> int:
        return 1

    def details(self) -> dict[str, int]:
        return dict(world_size=1)

    def describe(self) -> str:
        return "hf"

    def replica_key(self, rank: int) -> tuple[int, ...]:
        return (rank,)

    def resolve(self, spec: ModelSpec) -> "HFLayout":
        return self

    def local_tensors(self, spec: ModelSpec, rank: int) -> list[LocalTensor]:
        return [
            LocalTensor(t.name, t.shape, spec[t.tensor].dtype,
                        (Piece(t.tensor, t.start, t.size, (0,) * len(t.start)),))
            for t in spec.hf_tensors()
        ]
