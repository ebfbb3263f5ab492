"""Per-transfer checksums on CUDA with Triton: the kernel path of `refit.executor.checksum`.

The checksum's definition, one seat's boxes (`Share`), the checked tensors (`_Views`) and the
torch path, which is the reference, are in `refit.executor.checksum`; this module computes the same
sums in one pass over the bytes.  Each block of a box, its dimensions merged where memory and box
order agree, becomes 2-D segments, cut into items of at most `_ITEM_CHUNKS` chunks of a row; the
item table is built on the first call and kept on the `Share` while the same tensors come back at
the same addresses; one launch per element width, mode and row-ness sums every item, and the
items' sums are added up per box.  Apart from `refit.executor.checksum` because this is launch
bookkeeping and GPU code (triton is imported here, on first use), while that module stays
the definition and its reference path.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from refit.boxes import Index
from refit.errors import InvalidInput
from refit.executor.values import int_view



class SeatBoxes(Protocol):
    """What the kernel path reads of one seat's boxes (`refit.executor.checksum.Share`, which
    imports this module: described here, not imported)."""

    boxes: tuple[Any, ...]  # BoxBlocks
    launches: Any  # the `_Launches` made last for this seat


class CheckedViews(Protocol):
    """What it reads of the checked tensors (`refit.executor.checksum._Views`)."""

    tensors: dict[str, torch.Tensor | None]
    device: torch.device
    checked: Any  # the identity of the tensors checked last (`checksum._Checked`)

    def of(self, name: str, ndim: int) -> torch.Tensor: ...

log = logging.getLogger("refit.executor")

_ITEM_CHUNKS = 128  # chunks of one row per kernel item: int32 running sums cannot overflow
_FIELDS = 8  # an item: offset, rows, cols, row stride, col stride, first index, index strides (row, col)
_CONFIG = {"num_warps": 4, "num_stages": 1}  # the kernel's launch (the probe tries others)


# ------------------------------------------------------------------------------------------------
# The kernel path (CUDA with Triton): blocks as 2-D segments, cut into items


class _Segment(NamedTuple):
    """A block with its dimensions merged: ``rows`` x ``cols`` elements at element offset ``off``
    (row and column strides ``lr``, ``lc``) whose box indices are ``idx + r * br + c * bc``."""

    off: int
    rows: int
    cols: int
    lr: int
    lc: int
    idx: int
    br: int
    bc: int


def _row_major(size: Index) -> list[int]:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= n
    return strides[::-1]


def _merged(size: Index, local: Index, box: Index) -> list[tuple[int, int, int]]:
    """(extent, local stride, box stride) of a block's dimensions, outer first, size-1 dims dropped
    and neighbours merged where both memory and box order run on (a contiguous run is one dim)."""
    dims: list[tuple[int, int, int]] = []  # inner first
    for n, ls, bs in reversed(list(zip(size, local, box))):
        if n == 1:
            continue
        if dims and ls == dims[-1][1] * dims[-1][0] and bs == dims[-1][2] * dims[-1][0]:
            m, l0, b0 = dims[-1]
            dims[-1] = (m * n, l0, b0)
        else:
            dims.append((n, ls, bs))
    return dims[::-1]


def _segments(off: int, idx: int, size: Index, local: Index, box: Index) -> list[_Segment]:
    """A block as 2-D segments: one, unless more than two dims stay apart after merging (then
    one per index of the outer ones)."""
    if 0 in size:
        return []
    dims = _merged(size, local, box)
    while len(dims) < 2:
        dims.insert(0, (1, 0, 0))
    (rows, lr, br), (cols, lc, bc) = dims[-2:]
    outer = dims[:-2]
    out = []
    for ks in itertools.product(*(range(n) for n, _, _ in outer)):
        o = off + sum(k * ls for k, (_, ls, _) in zip(ks, outer))
        i = idx + sum(k * bs for k, (_, _, bs) in zip(ks, outer))
        out.append(_Segment(o, rows, cols, lr, lc, i, br, bc))
    return out


class _Group(NamedTuple):
    """One launch: items[start:end] of one element width, mode and row-ness."""

    width: int
    mode: int  # 0: any column stride; 1: unit stride; 2: unit stride and 16-byte aligned
    rows: bool  # items of several rows
    start: int
    end: int


@dataclass
class _Launches:
    """The kernel's work for one set of tensors: the item table and launches, on the device."""

    items: torch.Tensor  # [N, _FIELDS] int64
    owners: torch.Tensor  # [N] the box (its position in SeatBoxes.boxes) of each item
    groups: list[_Group]
    bases: dict[int, str]  # element width -> the local tensor whose address offsets count from
    made_for: Any  # `views.checked` of the tensors it was made for (their addresses)


def _sums_kernel(share: SeatBoxes, views: CheckedViews) -> torch.Tensor | None:
    """The sums by the kernel, or None where it cannot run (offsets that are not whole elements)."""
    launches = _launches(share, views)
    if launches is None:
        return None
    partial = torch.empty((launches.items.shape[0], 2), dtype=torch.int64, device=views.device)
    kernel = _kernel()
    with torch.cuda.device(views.device) if views.device.type == "cuda" else contextlib.nullcontext():
        for g in launches.groups:
            base = int_view(views.tensors[launches.bases[g.width]])
            vec = 16 // g.width
            block = 32 * _CONFIG["num_warps"] * vec
            kernel[(g.end - g.start,)](base, launches.items[g.start:g.end], partial[g.start:g.end], BLOCK=block,
                                       MODE=g.mode, ROWS=g.rows, WIDE=g.width > 2, VEC=vec, **_CONFIG)
    out = torch.zeros((len(share.boxes), 2), dtype=torch.int64, device=views.device)
    return out.index_add_(0, launches.owners, partial)


def _launches(share: SeatBoxes, views: CheckedViews) -> _Launches | None:
    """The cached launches when the very same tensors are at the same addresses, else new ones."""
    old = share.launches
    if old is not None and old.made_for is views.checked:
        return old
    made = _make_launches(share, views)
    if made is not None:
        share.launches = made
    return made


def _bases(views: CheckedViews) -> dict[int, str] | None:
    """Per element width, the tensor whose address the item offsets count from: a 16-byte aligned
    one where there is one.  None if some tensor's offset from it is not a whole element."""
    bases: dict[int, str] = {}
    for name, t in views.tensors.items():
        w = t.element_size()
        if w not in bases or (views.tensors[bases[w]].data_ptr() % 16 and t.data_ptr() % 16 == 0):
            bases[w] = name
    for t in views.tensors.values():
        if (t.data_ptr() - views.tensors[bases[t.element_size()]].data_ptr()) % t.element_size():
            return None
    return bases


def _segment_table(share: SeatBoxes, views: CheckedViews, bases: dict[int, str]) -> list[list[int]]:
    """One row per segment: its `_Segment` fields, its box's position, its element width."""
    rows = []
    for n, box in enumerate(share.boxes):
        strides = _row_major(box.box)
        for b in box.blocks:
            v = views.of(b.local, len(b.size))
            w = v.element_size()
            off = (v.data_ptr() - views.tensors[bases[w]].data_ptr()) // w
            off += sum(s * st for s, st in zip(b.local_start, v.stride()))
            idx = sum(s * st for s, st in zip(b.box_start, strides))
            rows += [[*seg, n, w] for seg in _segments(off, idx, b.size, v.stride(), strides)]
    return rows


def _make_launches(share: SeatBoxes, views: CheckedViews) -> _Launches | None:
    bases = _bases(views)
    if bases is None:
        log.warning("checksums: a local tensor's offset is not a whole element; the torch path runs")
        return None
    table = _segment_table(share, views, bases)
    seg = torch.tensor(table, dtype=torch.int64).view(-1, _FIELDS + 2)
    items, owners, keys = _items(seg, {w: views.tensors[name].data_ptr() % 16 == 0 for w, name in bases.items()})
    order = torch.sort(keys, stable=True).indices
    items, owners, keys = items[order].contiguous(), owners[order], keys[order].tolist()
    groups, start = [], 0
    for key, count in itertools.groupby(keys):
        end = start + sum(1 for _ in count)
        if end - start >= 2 ** 31:
            raise InvalidInput(f"checksums: {end - start} kernel items exceed one launch's grid")
        groups.append(_Group(key // 100, key // 10 % 10, bool(key % 10), start, end))
        start = end
    return _Launches(items.to(views.device), owners.to(views.device), groups, bases, views.checked)


def _items(seg: torch.Tensor, aligned_base: dict[int, bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut segments into kernel items of at most `_ITEM_CHUNKS` chunks of a row each: several
    rows of a short-rowed segment, or a piece of one long row.  Returns the items, the box of
    each, and each item's launch key (width * 100 + mode * 10 + several rows)."""
    off, rows, cols, lr, lc, idx, br, bc, owner, width = seg.unbind(1)
    vec = 16 // width
    block = 32 * _CONFIG["num_warps"] * vec
    longest = _ITEM_CHUNKS * block
    long_row = cols > longest
    per_rows = torch.where(long_row, 1, (_ITEM_CHUNKS // -(-cols // block)).clamp(min=1))
    piece = torch.where(long_row, longest, cols)
    n_cols = -(-cols // piece)
    count = -(-rows // per_rows) * n_cols
    rep = torch.repeat_interleave(torch.arange(len(count)), count)
    j = torch.arange(int(count.sum())) - torch.repeat_interleave(count.cumsum(0) - count, count)
    ri, qi = j // n_cols[rep], j % n_cols[rep]
    r0, c0 = ri * per_rows[rep], qi * piece[rep]
    i_rows = torch.minimum(per_rows[rep], rows[rep] - r0)
    i_cols = torch.minimum(piece[rep], cols[rep] - c0)
    i_off = off[rep] + r0 * lr[rep] + c0 * lc[rep]
    i_idx = idx[rep] + r0 * br[rep] + c0 * bc[rep]
    items = torch.stack((i_off, i_rows, i_cols, lr[rep], lc[rep], i_idx, br[rep], bc[rep]), 1)
    v, w = vec[rep], width[rep]
    unit = lc[rep] == 1
    base_ok = torch.tensor([aligned_base.get(int(x), False) for x in range(5)])[w]
    aligned = unit & base_ok & (i_off % v == 0) & ((i_rows == 1) | (lr[rep] % v == 0)) & (i_cols % v == 0)
    mode = torch.where(aligned, 2, unit.long())
    return items, owner[rep], w * 100 + mode * 10 + (i_rows > 1).long()


# ------------------------------------------------------------------------------------------------
# The Triton kernel


_checksum_row: Any = None  # set by _kernel


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    """The kernel, compiled on first use (importing this module does not import triton).

    A program sums one item: ``rows`` rows of ``cols`` elements.  Per lane (``lane`` = position in
    a chunk of ``BLOCK`` elements of a row) it keeps running sums ``a`` (of the elements) and ``b``
    (of the ``a`` before each chunk), so that ``(K - 1) * a - b`` is the sum of each element times
    its chunk number ``k``; rows fold the same way.  The element weights (row, chunk, lane) are
    applied once at the end, to the program's totals: no multiplication per element.  ``a`` and
    ``b`` of one row are int32 for elements of 1 and 2 bytes (at most 128 chunks: no overflow)."""
    global _checksum_row
    import triton
    import triton.language as tl

    @triton.jit
    def checksum_row(row, cols, lc, lane, BLOCK: tl.constexpr, MODE: tl.constexpr, WIDE: tl.constexpr):
        # (a, b) per lane over one row: a = sum_k x_k, b = sum_k (K - 1 - k) * x_k, as int64
        if WIDE:
            a = tl.zeros([BLOCK], tl.int64)
            b = tl.zeros([BLOCK], tl.int64)
        else:
            a = tl.zeros([BLOCK], tl.int32)
            b = tl.zeros([BLOCK], tl.int32)
        for k in range(tl.cdiv(cols, BLOCK)):
            c = k * BLOCK + lane
            if MODE == 0:
                ptrs = row + c.to(tl.int64) * lc
            else:
                ptrs = row + c
            x = tl.load(ptrs, mask=c < cols, other=0)
            b += a
            a += x.to(a.dtype)
        return a.to(tl.int64), b.to(tl.int64)

    # The kernel calls the row body by its module-level name: Triton's interpreter re-executes a
    # kernel's source with its module's globals, without the closure.
    _checksum_row = checksum_row

    @triton.jit
    def box_sums_kernel(base, items, out, BLOCK: tl.constexpr, MODE: tl.constexpr, ROWS: tl.constexpr,
                        WIDE: tl.constexpr, VEC: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        item = items + pid * 8
        off = tl.load(item)
        nrows = tl.load(item + 1).to(tl.int32)
        cols = tl.load(item + 2).to(tl.int32)
        lr = tl.load(item + 3)
        lc = tl.load(item + 4)
        idx = tl.load(item + 5)
        br = tl.load(item + 6)
        bc = tl.load(item + 7)
        if MODE == 2:  # unit stride, 16-byte aligned rows, whole vectors: 16-byte loads
            off = tl.multiple_of(off, VEC)
            lr = tl.multiple_of(lr, VEC)
            cols = tl.multiple_of(cols, VEC)
        lane = tl.arange(0, BLOCK)
        if ROWS:
            t1 = tl.zeros([BLOCK], tl.int64)  # sum of the rows' a
            tb = tl.zeros([BLOCK], tl.int64)  # sum of the rows' b
            tr = tl.zeros([BLOCK], tl.int64)  # running sum of t1: (rows - 1) * t1 - tr weighs row r by r
            for r in range(nrows):
                a, b = _checksum_row(base + off + r * lr, cols, lc, lane, BLOCK, MODE, WIDE)
                tr += t1
                t1 += a
                tb += b
        else:
            t1, tb = _checksum_row(base + off, cols, lc, lane, BLOCK, MODE, WIDE)
        s1 = tl.sum(t1, axis=0)
        chunk_w = (tl.cdiv(cols, BLOCK).to(tl.int64) - 1) * s1 - tl.sum(tb, axis=0)  # sum of x * chunk
        lane_w = tl.sum(lane.to(tl.int64) * t1, axis=0)  # sum of x * lane
        s2 = (idx + 1) * s1 + bc * (BLOCK * chunk_w + lane_w)
        if ROWS:
            s2 += br * ((nrows.to(tl.int64) - 1) * s1 - tl.sum(tr, axis=0))
        tl.store(out + pid * 2, s1)
        tl.store(out + pid * 2 + 1, s2)

    return box_sums_kernel
