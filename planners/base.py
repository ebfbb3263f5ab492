"""What planners share: the planner protocol and the source index."""

from __future__ import annotations

from typing import Protocol

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


SourceIndex = dict[str, list[tuple[Box, list[int]]]]


def source_index(spec: ModelSpec, src: Layout) -> SourceIndex:
    """Canonical tensor -> [(box, ranks holding exactly that box)].  Boxes of one tensor must be
    disjoint (replicas hold *identical* boxes); the planners rely on that to send each element once."""
    index: dict[str, dict[Box, list[int]]] = {}
    for rank, held in enumerate(all_holdings(spec, src)):
        for tensor, boxes in held.items():
            for b in boxes:
                index.setdefault(tensor, {}).setdefault(b, []).append(rank)
    out: SourceIndex = {}
    for tensor, boxes in index.items():
        items = list(boxes.items())
        for i, (a, _) in enumerate(items):
            for b, _ in items[i + 1:]:
                if intersect(a, b):
                    raise AssertionError(f"source layout holds overlapping boxes {a} and {b} of {tensor}")
        out[tensor] = items
    return out


def sources_for(index: SourceIndex, tensor: str, box: Box, where: str) -> list[tuple[Box, list[int]]]:
    """The parts of ``box`` and the source ranks holding each; refuse if the sources miss any element."""
    found, covered = [], 0
    for sbox, ranks in index.get(tensor, ()):
        inter = intersect(box, sbox)
        if inter:
            found.append((inter, ranks))
            covered += volume(inter[1])
    if covered != volume(box[1]):
        raise RefitError(f"source layout does not hold all of {tensor} {list(box[0])}+{list(box[1])} needed by {where}")
    return found


def total_bytes(spec: ModelSpec, dst_holdings: list[dict[str, list[Box]]]) -> int:
    return sum(volume(b[1]) * DTYPE_BYTES[spec[t].dtype] for h in dst_holdings for t, bs in h.items() for b in bs)
