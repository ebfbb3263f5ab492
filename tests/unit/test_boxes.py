"""Unit tests of refit.boxes: the box arithmetic checked against numpy slicing of real arrays."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from refit.boxes import intersect, join_runs, merge_boxes, shift, split_box, volume

SETTINGS = settings(max_examples=150, deadline=None)


def mask(shape: tuple[int, ...], boxes) -> np.ndarray:
    """Boolean array marking the elements the boxes cover (numpy slicing does the maths)."""
    m = np.zeros(shape, dtype=bool)
    for start, size in boxes:
        m[tuple(slice(s, s + z) for s, z in zip(start, size))] = True
    return m


@st.composite
def shapes(draw, max_ndim: int = 4) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=max_ndim)))


@st.composite
def boxes_in(draw, shape: tuple[int, ...]):
    start = tuple(draw(st.integers(0, n - 1)) for n in shape)
    size = tuple(draw(st.integers(1, n - s)) for n, s in zip(shape, start))
    return start, size


@st.composite
def two_boxes(draw):
    shape = draw(shapes())
    return shape, draw(boxes_in(shape)), draw(boxes_in(shape))


def test_known_values():
    assert volume((3, 4, 5)) == 60 and volume(()) == 1
    assert intersect(((0, 0), (4, 4)), ((2, 3), (4, 4))) == ((2, 3), (2, 1))
    assert intersect(((0, 0), (2, 2)), ((2, 0), (2, 2))) is None  # touching is not overlapping
    assert shift((5, 6), (1, 2)) == (6, 8) and shift((5, 6), (1, 2), -1) == (4, 4)
    assert join_runs([(4, 2), (0, 2), (2, 2), (9, 1), (0, 2)]) == [(0, 6), (9, 1)]
    # 16 expert pieces of one layer [1, 1, I, H] of [L, E, I, H] become one box
    pieces = [((3, e, 0, 0), (1, 1, 8, 4)) for e in range(16)]
    assert merge_boxes(pieces) == [((3, 0, 0, 0), (1, 16, 8, 4))]
    assert split_box(((0, 0), (4, 6)), 12) == [((0, 0), (2, 6)), ((2, 0), (2, 6))]


@SETTINGS
@given(two_boxes())
def test_intersect_is_the_overlap_of_the_slices(case):
    shape, a, b = case
    inter = intersect(a, b)
    both = mask(shape, [a]) & mask(shape, [b])
    if inter is None:
        assert not both.any()
    else:
        assert (mask(shape, [inter]) == both).all()
        assert intersect(b, a) == inter


@st.composite
def tilings(draw):
    """A shape cut into disjoint boxes (a grid of random cuts per dimension), some dropped, some
    given twice (replicas hold identical boxes)."""
    shape = draw(shapes())
    cuts = [sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=3)))) if n > 1 else [] for n in shape]
    edges = [[0] + c + [n] for c, n in zip(cuts, shape)]
    cells = [((), ())]
    for e in edges:
        cells = [(s + (lo,), z + (hi - lo,)) for s, z in cells for lo, hi in zip(e, e[1:])]
    keep = draw(st.lists(st.booleans(), min_size=len(cells), max_size=len(cells)))
    chosen = [c for c, k in zip(cells, keep) if k] or cells[:1]
    dupes = draw(st.lists(st.sampled_from(chosen), max_size=2))
    return shape, chosen + dupes


@SETTINGS
@given(tilings())
def test_merge_boxes_covers_the_same_elements_with_disjoint_boxes(case):
    shape, boxes = case
    merged = merge_boxes(boxes)
    assert (mask(shape, merged) == mask(shape, boxes)).all()
    assert sum(volume(z) for _, z in merged) == int(mask(shape, boxes).sum())  # disjoint
    assert len(merged) <= len(set(boxes))
    assert merged == sorted(merged) and merge_boxes(merged) == merged  # sorted, and a fixed point


@SETTINGS
@given(st.data())
def test_split_box_tiles_the_box_in_row_major_order(data):
    shape = data.draw(shapes())
    box = data.draw(boxes_in(shape))
    limit = data.draw(st.integers(1, volume(box[1]) + 2))
    pieces = split_box(box, limit)
    values = np.arange(volume(shape)).reshape(shape)

    def cut(b):
        return values[tuple(slice(s, s + z) for s, z in zip(*b))]

    for p in pieces:
        assert 1 <= volume(p[1]) <= limit
        flat = cut(p).reshape(-1)
        # each piece is one contiguous run of the box's row-major order
        box_order = cut(box).reshape(-1)
        at = int(np.flatnonzero(box_order == flat[0])[0])
        assert (box_order[at:at + flat.size] == flat).all()
    # concatenated, the pieces are the box's elements in row-major order, each once
    assert (np.concatenate([cut(p).reshape(-1) for p in pieces]) == cut(box).reshape(-1)).all()


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 5)), min_size=1, max_size=12), st.randoms())
def test_join_runs_covers_the_same_integers(gaps_and_lengths, rnd):
    # callers pass the runs of disjoint pieces, replicas repeated: build such a list, shuffled
    intervals, at = [], 0
    for gap, n in gaps_and_lengths:
        intervals.append((at + gap, n))
        at += gap + n
    intervals += rnd.sample(intervals, k=min(2, len(intervals)))
    rnd.shuffle(intervals)
    runs = join_runs(intervals)
    covered = {i for lo, n in intervals for i in range(lo, lo + n)}
    assert {i for lo, n in runs for i in range(lo, lo + n)} == covered
    assert all(a[0] + a[1] < b[0] for a, b in zip(runs, runs[1:]))  # sorted, none touching
