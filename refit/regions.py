"""Where a canonical box lives in one rank's local tensors — the bridge from plans to bytes.

A transfer moves box ``B`` of a canonical tensor as one row-major block.  On each end, `regions`
says which `Block` s of which local tensors make up that box: the sender gathers them into its
buffer, the receiver scatters them out.  Everything is computed from the layouts, once per plan.
`Block` is the one block type of refit: the offline resharder, the executor's schedule and the
test simulator all speak it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, NamedTuple

from refit.boxes import Box, Index, intersect
from refit.layouts.base import LocalTensor, Piece


class Block(NamedTuple):
    """``size`` elements at ``local_start`` of local tensor ``local`` (viewed with the canonical
    number of dimensions) are the ones at ``box_start`` of a transferred box."""

    local: str
    local_start: Index
    box_start: Index
    size: Index


class PieceIndex:
    """A rank's pieces grouped by canonical tensor, to answer `regions` queries."""

    def __init__(self, tensors: Iterable[LocalTensor]) -> None:
        self.tensors: dict[str, LocalTensor] = {}
        self.by_tensor: dict[str, list[tuple[LocalTensor, Piece]]] = defaultdict(list)
        for lt in tensors:
            self.tensors[lt.name] = lt
            for p in lt.pieces:
                self.by_tensor[p.tensor].append((lt, p))

    def regions(self, tensor: str, box: Box) -> list[Block]:
        """The local regions holding ``box`` of ``tensor``.  A box held several times on one rank
        (never the case in the supported layouts) would be returned once per copy."""
        out = []
        for lt, p in self.by_tensor.get(tensor, ()):
            inter = intersect(box, (p.start, p.size))
            if inter is None:
                continue
            start, size = inter
            local = tuple(ls + s - ps for ls, s, ps in zip(p.local_start, start, p.start))
            out.append(Block(lt.name, local, tuple(s - b for s, b in zip(start, box[0])), size))
        return out


def slices(start: Index, size: Index) -> tuple[slice, ...]:
    return tuple(slice(s, s + n) for s, n in zip(start, size))
