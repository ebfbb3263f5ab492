"""Box arithmetic: the small pure functions planning and copying are built from.

A box is a pair ``(start, size)`` of equal-length int tuples: the region
``[start[d], start[d] + size[d])`` on every dimension ``d`` of some tensor.
"""

from __future__ import annotations

import math
from typing import Iterable

Index = tuple[int, ...]
Box = tuple[Index, Index]


def volume(size: Index) -> int:
    return math.prod(size)


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when they do not overlap."""
    start, size = [], []
    for s0, z0, s1, z1 in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(s0, s1), min(s0 + z0, s1 + z1)
        if hi <= lo:
            return None
        start.append(lo)
        size.append(hi - lo)
    return tuple(start), tuple(size)


def shift(start: Index, by: Index, sign: int = 1) -> Index:
    return tuple(s + sign * b for s, b in zip(start, by))


def merge_boxes(boxes: Iterable[Box], joined_along0: bool = False) -> list[Box]:
    """Coalesce boxes that touch along one dimension and agree on all others (e.g. the 16 expert
    pieces an EP rank holds of one layer become one box).  Identical boxes collapse to one.
    ``joined_along0``: the caller has already joined the runs along dimension 0 of boxes equal on
    all other dimensions (as `_merge_layers` does), so that first pass is skipped."""
    current = set(boxes)
    if not current:
        return []
    ndim = len(next(iter(current))[0])
    if not joined_along0:
        current = _merge_layers(current)  # most pieces differ only in their layer: one cheap pass first
    changed = True
    while changed:
        changed = False
        for d in reversed(range(ndim)):
            if len(current) == 1:
                break
            current, merged_some = _merge_along(current, d)
            changed |= merged_some
    return sorted(current)


def join_runs(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ``(start, length)`` intervals with touching ones joined (duplicates collapse)."""
    intervals = sorted(set(intervals))
    out = [intervals[0]]
    for lo, n in intervals[1:]:
        last_lo, last_n = out[-1]
        if last_lo + last_n == lo:
            out[-1] = (last_lo, last_n + n)
        else:
            out.append((lo, n))
    return out


def _merge_layers(boxes: set[Box]) -> set[Box]:
    """`_merge_along` dimension 0, specialised: no tuple surgery in the inner loop."""
    groups: dict[tuple[Index, Index], list[tuple[int, int]]] = {}
    for s, z in boxes:
        groups.setdefault((s[1:], z[1:]), []).append((s[0], z[0]))
    return {((lo,) + rest_s, (n,) + rest_z) for (rest_s, rest_z), runs in groups.items() for lo, n in join_runs(runs)}


def _merge_along(boxes: set[Box], d: int) -> tuple[set[Box], bool]:
    """One pass of `merge_boxes` along dimension ``d``; also says whether anything merged."""
    # Sort by (everything but d, position on d); then runs that touch along d are neighbours.
    keyed = sorted(((s[:d] + s[d + 1:], z[:d] + z[d + 1:], s[d], z[d]) for s, z in boxes))
    merged: set[Box] = set()
    prev_rest, lo, n = None, 0, 0
    for rest_s, rest_z, s_d, z_d in keyed:
        rest = (rest_s, rest_z)
        if rest == prev_rest and lo + n == s_d:
            n += z_d
            continue
        if prev_rest is not None:
            merged.add((prev_rest[0][:d] + (lo,) + prev_rest[0][d:], prev_rest[1][:d] + (n,) + prev_rest[1][d:]))
        prev_rest, lo, n = rest, s_d, z_d
    merged.add((prev_rest[0][:d] + (lo,) + prev_rest[0][d:], prev_rest[1][:d] + (n,) + prev_rest[1][d:]))
    return merged, len(merged) < len(boxes)


def split_box(box: Box, max_elems: int) -> list[Box]:
    """Cut a box into boxes of at most ``max_elems`` elements (at least one element each),
    cutting the outermost dimension that is larger than 1 first, so pieces stay contiguous."""
    start, size = box
    if volume(size) <= max_elems:
        return [box]
    d = next(i for i, n in enumerate(size) if n > 1)
    inner = volume(size[d + 1:])
    if inner <= max_elems:
        step = max(1, max_elems // inner)
        return [
            (start[:d] + (start[d] + lo,) + start[d + 1:], size[:d] + (min(step, size[d] - lo),) + size[d + 1:])
            for lo in range(0, size[d], step)
        ]
    out = []
    for lo in range(size[d]):
        row = (start[:d] + (start[d] + lo,) + start[d + 1:], size[:d] + (1,) + size[d + 1:])
        out.extend(split_box(row, max_elems))
    return out
