"""What planners share: the planner protocol and the source index."""

from __future__ import annotations

import bisect
import math
from itertools import product
from typing import ClassVar, NamedTuple, Protocol

from refit.boxes import Box, Index, intersect, volume
from refit.dtypes import DTYPE_BYTES
from refit.errors import InvalidInput
from refit.layouts import Layout, all_holdings
from refit.plan import Placement, Plan
from refit.spec import ModelSpec


class Planner(Protocol):
    name: ClassVar[str]  # its key in `refit.planners.PLANNERS`: ``p2p`` in ``refit plan --planner p2p``

    def plan(self, spec: ModelSpec, src: Layout, dst: Layout, placement: Placement, bucket_bytes: int) -> Plan:
        """Layouts are resolved (``layout.resolve(spec)``) before they are passed in."""
        ...


class SortedBoxes(NamedTuple):
    """Source boxes sorted by their start on one dimension, with the longest extent on it."""

    items: list[tuple[Box, list[int]]]
    starts: list[int]
    max_extent: int

    @classmethod
    def along(cls, items: list[tuple[Box, list[int]]], dim: int) -> "SortedBoxes":
        items = sorted(items, key=lambda it: (it[0][0][dim], it[0]))
        return cls(items, [b[0][dim] for b, _ in items], max(b[1][dim] for b, _ in items))

    def _span(self, box: Box, dim: int) -> tuple[int, int]:
        lo, hi = box[0][dim], box[0][dim] + box[1][dim]
        first = bisect.bisect_left(self.starts, lo - self.max_extent + 1)
        return first, bisect.bisect_left(self.starts, hi, first)

    def candidates(self, box: Box, dim: int) -> list[tuple[Box, list[int]]]:
        first, end = self._span(box, dim)
        return self.items[first:end]

    def count(self, box: Box, dim: int) -> int:
        first, end = self._span(box, dim)
        return end - first


class Grid(NamedTuple):
    """Source boxes that tile a product of intervals, one list per dimension (layers x experts x
    rows x columns): the parts of a destination box are then the product of its overlaps on each
    dimension, found without comparing it with every source box."""

    starts: tuple[list[int], ...]  # per dimension, the intervals' starts, sorted (intervals disjoint)
    sizes: tuple[list[int], ...]
    ranks: dict[Index, list[int]]  # a source box's start (which names it in a grid) -> its ranks

    @classmethod
    def of(cls, items: list[tuple[Box, list[int]]]) -> "Grid | None":
        """The grid the (distinct) boxes form, or None when they are not a full product of
        per-dimension intervals disjoint on every dimension."""
        ndim = len(items[0][0][0])
        per_dim = [sorted({(b[0][d], b[1][d]) for b, _ in items}) for d in range(ndim)]
        if math.prod(len(iv) for iv in per_dim) != len(items):
            return None  # distinct boxes, as many as the product: then they are the product
        if any(s0 + n0 > s1 for iv in per_dim for (s0, n0), (s1, _) in zip(iv, iv[1:])):
            return None
        return cls(tuple([s for s, _ in iv] for iv in per_dim), tuple([n for _, n in iv] for iv in per_dim),
                   {b[0]: ranks for b, ranks in items})

    def parts(self, box: Box, outer: int) -> tuple[list[tuple[Index, Index, list[int]]], int]:
        """``box`` cut by the grid, with the ranks holding each part, ordered by their source box's
        start on dimension ``outer`` first, then by that start (the order of `SortedBoxes`); and
        how many of the box's elements the parts cover."""
        starts, sizes, src_starts = [], [], []  # per dimension: the overlaps and their intervals
        for lo, n, iv_starts, iv_sizes in zip(box[0], box[1], self.starts, self.sizes):
            hi = lo + n
            st, sz, ss = [], [], []
            for i in range(max(0, bisect.bisect_right(iv_starts, lo) - 1), len(iv_starts)):
                s = iv_starts[i]
                if s >= hi:
                    break
                a, b = max(s, lo), min(s + iv_sizes[i], hi)
                if a < b:
                    st.append(a)
                    sz.append(b - a)
                    ss.append(s)
            starts.append(st)
            sizes.append(sz)
            src_starts.append(ss)
        ranks = self.ranks
        covered = math.prod(sum(sz) for sz in sizes)
        if outer == 0:  # product order is already start order
            cut = zip(product(*starts), product(*sizes), product(*src_starts))
            return [(st, sz, ranks[ss]) for st, sz, ss in cut], covered
        out = []
        for i in range(len(starts[outer])):  # one slab per overlap on the outer dimension
            slab = [lists[:outer] + [lists[outer][i:i + 1]] + lists[outer + 1:]
                    for lists in (starts, sizes, src_starts)]
            out.extend((st, sz, ranks[ss]) for st, sz, ss in zip(*(product(*lists) for lists in slab)))
        return out, covered


class TensorSources(NamedTuple):
    """The distinct source boxes of one canonical tensor, sorted along dimension 0 (layers, or
    vocab rows) and along dimension 1 (experts, or rows): a destination box's candidate sources
    are found by bisection on whichever of the two narrows them more (10^4 expert boxes of a 1T
    model would otherwise each be compared with every destination box).  When the boxes form a
    `Grid` (the usual case), the parts are cut from it instead of intersected one by one."""

    by_dim: tuple[SortedBoxes, ...]
    grid: Grid | None = None


SourceIndex = dict[str, TensorSources]


def source_index(spec: ModelSpec, src: Layout) -> SourceIndex:
    """Canonical tensor -> its distinct source boxes and the ranks holding each.  Boxes of one
    tensor must be disjoint (replicas hold *identical* boxes); the planners rely on that to send
    each element once."""
    index: dict[str, dict[Box, list[int]]] = {}
    for rank, held in enumerate(all_holdings(spec, src)):
        for tensor, boxes in held.items():
            for b in boxes:
                index.setdefault(tensor, {}).setdefault(b, []).append(rank)
    out: SourceIndex = {}
    for tensor, boxes in index.items():
        items = sorted(boxes.items())
        grid = Grid.of(items)
        if grid is None:  # a grid's boxes are disjoint by construction
            _check_disjoint(tensor, items)
        ndim = len(items[0][0][0])
        out[tensor] = TensorSources(tuple(SortedBoxes.along(items, d) for d in range(min(ndim, 2))), grid)
    return out


def _check_disjoint(tensor: str, items: list[tuple[Box, list[int]]]) -> None:
    """Sweep along dimension 0 (items sorted by start): only boxes whose dim-0 ranges overlap are
    compared, which keeps a 1T-parameter model's 10^4 expert boxes from costing 10^8 comparisons."""
    active: list[Box] = []
    for box, _ in items:
        lo = box[0][0]
        active = [a for a in active if a[0][0] + a[1][0] > lo]
        for other in active:
            if intersect(box, other):
                raise AssertionError(f"source layout holds overlapping boxes {other} and {box} of {tensor}")
        active.append(box)


def sources_for(index: SourceIndex, tensor: str, box: Box, where: str) -> list[tuple[Box, list[int]]]:
    """The parts of ``box`` and the source ranks holding each; refuse if the sources miss any element."""
    return [((start, size), ranks) for start, size, ranks in source_parts(index, tensor, box, where)]


def source_parts(index: SourceIndex, tensor: str, box: Box, where: str) -> list[tuple[Index, Index, list[int]]]:
    """`sources_for` as (start, size, ranks) triples."""
    found, covered = [], 0
    src = index.get(tensor)
    if src is not None:
        counts = [(sb.count(box, d), d) for d, sb in enumerate(src.by_dim)]
        outer = min(counts)[1]
        if src.grid is not None:
            found, covered = src.grid.parts(box, outer)
        else:
            for sbox, ranks in src.by_dim[outer].candidates(box, outer):
                inter = intersect(box, sbox)
                if inter:
                    found.append((inter[0], inter[1], ranks))
                    covered += volume(inter[1])
    if covered != volume(box[1]):
        raise InvalidInput(f"source layout does not hold all of {tensor} {list(box[0])}+{list(box[1])} needed by {where}")
    return found


def total_bytes(spec: ModelSpec, dst_holdings: list[dict[str, list[Box]]]) -> int:
    return sum(volume(b[1]) * DTYPE_BYTES[spec[t].dtype] for h in dst_holdings for t, bs in h.items() for b in bs)
