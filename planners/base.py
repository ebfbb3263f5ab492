"""What planners share: the planner protocol and the source index."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from refit.boxes import Box, intersect, volume
from refit.dtypes import DTYPE_BYTES
from refit.errors import RefitError
from refit.layouts import Layout, all_holdings
from refit.plan import Placement, Plan
from refit.spec import ModelSpec


class Planner(Protocol):
    name: str

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

    def candidates(self, box: Box, dim: int) -> list[tuple[Box, list[int]]]:
        lo, hi = box[0][dim], box[0][dim] + box[1][dim]
        first = bisect.bisect_left(self.starts, lo - self.max_extent + 1)
        return self.items[first:bisect.bisect_left(self.starts, hi, first)]


class TensorSources(NamedTuple):
    """The distinct source boxes of one canonical tensor, sorted along dimension 0 (layers, or
    vocab rows) and along dimension 1 (experts, or rows): a destination box's candidate sources
    are found by bisection on whichever of the two narrows them more (10^4 expert boxes of a 1T
    model would otherwise each be compared with every destination box)."""

    by_dim: tuple[SortedBoxes, ...]


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
        _check_disjoint(tensor, items)
        ndim = len(items[0][0][0])
        out[tensor] = TensorSources(tuple(SortedBoxes.along(items, d) for d in range(min(ndim, 2))))
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
    found, covered = [], 0
    src = index.get(tensor)
    if src is not None:
        options = [(len(c), d, c) for d, sb in enumerate(src.by_dim) for c in (sb.candidates(box, d),)]
        for sbox, ranks in min(options, key=lambda o: o[:2])[2]:
            inter = intersect(box, sbox)
            if inter:
                found.append((inter, ranks))
                covered += volume(inter[1])
    if covered != volume(box[1]):
        raise RefitError(f"source layout does not hold all of {tensor} {list(box[0])}+{list(box[1])} needed by {where}")
    return found


def total_bytes(spec: ModelSpec, dst_holdings: list[dict[str, list[Box]]]) -> int:
    return sum(volume(b[1]) * DTYPE_BYTES[spec[t].dtype] for h in dst_holdings for t, bs in h.items() for b in bs)
