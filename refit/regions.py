"""Where a canonical box lives in one rank's local tensors — the bridge from plans to bytes.

A transfer moves box ``B`` of a canonical tensor as one row-major block.  On each end, `regions`
says which `Block` s of which local tensors make up that box: the sender gathers them into its
buffer, the receiver scatters them out.  Everything is computed from the layouts, once per plan.
`Block` is the one block type of refit: the offline resharder, the executor's schedule and the
test simulator all speak it.
"""

from __future__ import annotations

import bisect
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


class _Sorted(NamedTuple):
    """A tensor's pieces sorted by their start on one dimension, with the longest extent on it:
    the pieces that may meet a box are found by bisection (a rank holds 10^3 expert pieces of one
    canonical tensor of a large MoE; compared one by one, compiling its share took minutes)."""

    starts: list[int]
    order: list[int]  # indexes into the tensor's piece list, in the order of ``starts``
    max_extent: int

    def span(self, lo: int, hi: int) -> tuple[int, int]:
        first = bisect.bisect_left(self.starts, lo - self.max_extent + 1)
        return first, bisect.bisect_left(self.starts, hi, first)


_FEW = 16  # pieces of a tensor below which a plain scan is as fast


class PieceIndex:
    """A rank's pieces grouped by canonical tensor, to answer `regions` queries."""

    def __init__(self, tensors: Iterable[LocalTensor]) -> None:
        self.tensors: dict[str, LocalTensor] = {}
        self.by_tensor: dict[str, list[tuple[LocalTensor, Piece]]] = defaultdict(list)
        for lt in tensors:
            self.tensors[lt.name] = lt
            for p in lt.pieces:
                self.by_tensor[p.tensor].append((lt, p))
        self._sorted: dict[str, tuple[_Sorted, ...]] = {}

    def _candidates(self, tensor: str, box: Box) -> list[tuple[LocalTensor, Piece]]:
        """The pieces of ``tensor`` that may meet ``box``, in their original order."""
        pieces = self.by_tensor.get(tensor, [])
        if len(pieces) < _FEW or not box[0]:
            return pieces
        dims = self._sorted.get(tensor)
        if dims is None:
            dims = self._sorted[tensor] = tuple(
                _Sorted([pieces[i][1].start[d] for i in order], order, max(p.size[d] for _, p in pieces))
                for d in range(min(2, len(box[0])))
                for order in [sorted(range(len(pieces)), key=lambda i: pieces[i][1].start[d])])
        spans = [(s.span(box[0][d], box[0][d] + box[1][d]), s) for d, s in enumerate(dims)]
        (first, end), best = min(spans, key=lambda x: x[0][1] - x[0][0])
        return [pieces[i] for i in sorted(best.order[first:end])]

    def regions(self, tensor: str, box: Box) -> list[Block]:
        """The local regions holding ``box`` of ``tensor``.  A box held several times on one rank
        (never the case in the supported layouts) would be returned once per copy."""
        out = []
        for lt, p in self._candidates(tensor, box):
            inter = intersect(box, (p.start, p.size))
            if inter is None:
                continue
            start, size = inter
            local = tuple(ls + s - ps for ls, s, ps in zip(p.local_start, start, p.start))
            out.append(Block(lt.name, local, tuple(s - b for s, b in zip(start, box[0])), size))
        return out


def slices(start: Index, size: Index) -> tuple[slice, ...]:
    return tuple(slice(s, s + n) for s, n in zip(start, size))
