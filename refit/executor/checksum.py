"""Per-transfer checksums: both ends of a verified refit fingerprint every stage-1 box they moved.

Why.  The bench verifies a refit bit for bit against canonical values every process can compute
(`refit.executor.values`).  A real refit moves the trainer's weights, which no engine can
predict.  So each end condenses every box it sent (a trainer) or received (an engine) into one
number, and the coordinator compares the two numbers of each transfer: a transfer whose ends
disagree names its tensor, box and ranks, for one extra read of the bytes each end moved and a
few bytes per transfer on the control plane.

Definition.  A plan's box is row-major over its canonical coordinates on both ends (`refit.plan`),
however each end lays it out locally (fused tensors, split pieces, padding, strided views).  For a
box of ``n`` elements let ``x_i`` (``i = 0 … n-1`` in that order) be element ``i``'s bits read as a
signed integer of its own width (`refit.executor.values.int_view`: int8, int16, int32),
sign-extended to 64 bits.  In wrapping 64-bit arithmetic::

    S1 = sum(x_i)              S2 = sum((i + 1) * x_i)          (mod 2**64)
    checksum = mix63((S1 + W * S2) mod 2**63)

``W`` is twice an odd constant and ``mix63`` a bijection of 63-bit values (xor-shifts and odd
multipliers), so the checksum is an int in [0, 2**63) that fits a signed 64-bit field.

What it detects.  Only bits count: NaN payloads, negative zeros and subnormals are plain integers
here, and CPU and CUDA agree bit for bit.  Whatever the data, in a box of fewer than 2**30
elements: any single flipped bit (``x_i`` moves by ``±2**k``, the folded value by ``2**k`` times an
odd number), and any two different elements swapped (``S1`` stays, ``S2`` moves by
``(x_i - x_j)(j - i)``, non-zero and below ``2**62`` in magnitude).  With the odds of a random
63-bit value: a box shifted by one element, a zeroed, stale or half-written box, another box's
bytes, most other corruption.  Not detected: changes made to keep both sums (the checksum is
linear, not cryptographic: it catches bugs and faults, not an adversary), and anything outside
the stage-1 boxes (padding, which no transfer covers).  Plans that gather whole tensors on source
roots (the broadcast planner) are refused: their stage-1 boxes leave from gathered copies that no
seat's tensors hold.

How it runs.  Each end finds its blocks of every box as the executor does
(`refit.executor.schedule.box_blocks`).  On CUDA with Triton one kernel reads every byte once:
each block, its dimensions merged where memory and box order agree, is cut into items of a few
hundred KiB, and each program of the launch sums one item with running sums (no multiplication
per element); the item table is built on the first call and reused while the same tensors come
back at the same addresses.  Elsewhere, or without Triton, torch computes the sums block by block
in bounded int64 chunks: that path is the reference.  Either way the sums stay on the device
until one ``tolist()`` at the end.  On an H200 the kernel reads 4.1-4.5 TB/s, about half a
same-size copy's time (bench/RESULTS.md, `bench/probes/checksum_speed.py`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import operator
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

import torch

from refit.boxes import Index, shift, split_box
from refit.errors import InvalidInput
from refit.executor.triton_support import triton_importable
from refit.executor.schedule import box_blocks, check_plan
from refit.executor.topology import Topology
from refit.executor.values import DEFAULT_CHUNK, _linear_index, int_view
from refit.layouts import Layout, LocalTensor, sent_tensors
from refit.layouts.quantized import DERIVED_PREFIX
from refit.plan import Plan
from refit.regions import Block, PieceIndex, slices
from refit.spec import ModelSpec

log = logging.getLogger("refit.executor")

_M63 = (1 << 63) - 1
_W = (2 * 0x9E3779B97F4A7C15) & _M63  # twice an odd number: keeps a flipped bit's change odd
_ITEM_CHUNKS = 128  # chunks of one row per kernel item: int32 running sums cannot overflow
_FIELDS = 8  # an item: offset, rows, cols, row stride, col stride, first index, index strides (row, col)
_CONFIG = {"num_warps": 4, "num_stages": 1}  # the kernel's launch (the probe tries others)
_CACHE_SIZE = 4
_DEREF = weakref.ref.__call__


def fold(s1: int, s2: int) -> int:
    """The checksum of a box whose sums are ``s1`` and ``s2`` (any ints, taken mod 2**64)."""
    v = (s1 + _W * s2) & _M63
    v ^= v >> 31
    v = (v * 0x7FB5D329728EA185) & _M63
    v ^= v >> 27
    v = (v * 0x81DADEF4BC2DD44D) & _M63
    v ^= v >> 33
    return v


def box_checksum(box: torch.Tensor) -> int:
    """The checksum of a whole box given as one tensor (any strides), row-major over its shape:
    what both ends compute of that box (for tests, and to check one box by hand)."""
    sums = _block_sums(int_view(box), tuple(box.shape), (0,) * box.dim(), DEFAULT_CHUNK)
    return fold(*sums.tolist())


def share_checksums(plan: Plan, spec: ModelSpec, src_layout: Layout, dst_layout: Layout, side: str, rank: int,
                    tensors: Mapping[str, torch.Tensor], phase: int | None = None) -> dict[int, int]:
    """Checksum of every stage-1 transfer of ``plan`` that rank ``rank`` of ``side`` (``src`` or
    ``dst``) sends or receives, by its index in ``plan.transfers``.  ``tensors``: that rank's
    local tensors by local name, in the dtypes the wire carries (``spec`` is the one the plan runs
    with, the layouts resolved against it).  ``phase``: only the transfers of that phase of a
    phased plan (its key in `Plan.phase_ranges`: an engine that stages one window at a time sums
    each phase before the next overwrites it).  Refuses (`InvalidInput`) a plan of another model or
    other layouts, a plan that gathers, and tensors missing or unlike the layout's."""
    share = _share(plan, spec, src_layout, dst_layout, side, rank, phase)
    views = _Views(share, tensors)
    sums = _sums(share, views, use_kernel=None)
    return {box.index: fold(s1, s2) for box, (s1, s2) in zip(share.boxes, sums.tolist())}


# ------------------------------------------------------------------------------------------------
# One seat's boxes


class BoxBlocks(NamedTuple):
    index: int  # the transfer's index in plan.transfers
    box: Index  # its size
    blocks: tuple[Block, ...]  # where its elements lie in the seat's local tensors


@dataclass
class Share:
    """One seat's stage-1 boxes and their blocks (pure data, cached per plan and seat)."""

    spec: ModelSpec
    locals: dict[str, LocalTensor]
    boxes: tuple[BoxBlocks, ...]
    launches: Any = field(default=None, repr=False)  # the kernel's `_Launches`, for the tensors seen last
    checked: _Checked | None = field(default=None, repr=False)  # the tensors checked last

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """The local tensors the boxes lie in, in order of first use."""
        return tuple(dict.fromkeys(b.local for box in self.boxes for b in box.blocks))


_shares: collections.OrderedDict[tuple[Any, ...], Share] = collections.OrderedDict()
_lock = threading.Lock()


def _share(plan: Plan, spec: ModelSpec, src: Layout, dst: Layout, side: str, rank: int,
           phase: int | None = None) -> Share:
    if side not in ("src", "dst"):
        raise InvalidInput(f"side must be src or dst, not {side!r}")
    key = (plan.plan_hash, src.describe(), dst.describe(), side, rank, phase)
    with _lock:
        share = _shares.get(key)
        if share is not None and share.spec is spec:
            _shares.move_to_end(key)
            return share
    share = _make_share(plan, spec, src, dst, side, rank, phase)
    with _lock:
        _shares[key] = share
        while len(_shares) > _CACHE_SIZE:
            _shares.popitem(last=False)
    return share


def _make_share(plan: Plan, spec: ModelSpec, src: Layout, dst: Layout, side: str, rank: int,
                phase: int | None = None) -> Share:
    check_plan(plan, spec, src, dst, Topology.one_per_rank(plan.placement))
    ranks = len(plan.placement.src_gpus if side == "src" else plan.placement.dst_gpus)
    if not 0 <= rank < ranks:
        raise InvalidInput(f"plan {plan.plan_hash} has {ranks} {side} ranks; there is no rank {rank}")
    if plan.gathers:
        raise InvalidInput(f"plan {plan.plan_hash} gathers whole tensors on source roots (planner {plan.planner}): "
                           "its boxes leave from gathered copies no seat holds, so its transfers have no checksums")
    locals_ = sent_tensors(spec, src if side == "src" else dst, rank)
    index, ep, sending = PieceIndex(locals_), (side, rank), side == "src"
    wanted = range(len(plan.transfers)) if phase is None else _phase_transfers(plan, phase)
    boxes = tuple(BoxBlocks(i, t.size, tuple(box_blocks(index, t, ep, whole=True, sending=sending)))
                  for i, t in ((i, plan.transfers[i]) for i in wanted)
                  if t.stage == 1 and (t.src if sending else t.dst) == rank)
    return Share(spec, {lt.name: lt for lt in locals_}, boxes)


def _phase_transfers(plan: Plan, phase: int) -> list[int]:
    """The indices of the transfers in phase ``phase``'s buckets."""
    for key, first, end in plan.phase_ranges():
        if key == phase:
            return [i for b in plan.buckets[first:end] for i in range(b.first, b.first + b.count)]
    raise InvalidInput(f"plan {plan.plan_hash} has no phase {phase}")


@dataclass(frozen=True)
class _Checked:
    """Tensors that passed `_check`: the very objects (weakly held) at the very addresses."""

    refs: tuple[weakref.ref, ...]
    ptrs: tuple[int, ...]
    device: torch.device

    def holds(self, flat: list[Any]) -> bool:
        try:
            return len(self.refs) == len(flat) and all(map(operator.is_, map(_DEREF, self.refs), flat)) \
                and tuple(map(torch.Tensor.data_ptr, flat)) == self.ptrs
        except (TypeError, RuntimeError):  # not tensors: `_check` says what
            return False


class _Views:
    """The seat's tensors as integer views with the canonical number of dimensions, checked
    against the layout (name, shape, dtype) and for one device.  The very tensor objects at the
    very addresses checked last time are not checked again (a MoE shard holds 10^4 of them), and
    reuse the kernel's launches: don't change a tensor's shape in place at the same address
    (``resize_``, ``as_strided_``) between calls."""

    def __init__(self, share: Share, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = {name: tensors.get(name) for name in share.names}
        flat = list(self.tensors.values())
        if share.checked is None or not share.checked.holds(flat):
            device = _check(share, self.tensors)
            share.checked = _Checked(tuple(map(weakref.ref, flat)), tuple(map(torch.Tensor.data_ptr, flat)), device)
        self.checked: _Checked = share.checked
        self.device = self.checked.device
        self._cache: dict[tuple[str, int], torch.Tensor] = {}

    def of(self, name: str, ndim: int) -> torch.Tensor:
        """Local tensor ``name`` as integers, viewed with ``ndim`` dimensions (leading 1s)."""
        v = self._cache.get((name, ndim))
        if v is None:
            t = int_view(self.tensors[name])
            v = self._cache[(name, ndim)] = t[(None,) * (ndim - t.dim())]
        return v


def _check(share: Share, tensors: Mapping[str, torch.Tensor | None]) -> torch.device:
    """Refuse tensors missing or unlike the layout's, or on several devices; their device."""
    for name, t in tensors.items():
        lt = share.locals[name]
        if not isinstance(t, torch.Tensor) and name.startswith(DERIVED_PREFIX):
            raise InvalidInput(f"{name} is missing: a trainer that cuts FP8 blocks sends values its executor derives "
                               f"each refit (`refit.executor.shared_blocks`); checksums need the member's tensors")
        if not isinstance(t, torch.Tensor):
            raise InvalidInput(f"local tensor {name} is missing: checksums need every tensor the plan moves")
        if tuple(t.shape) != lt.shape or str(t.dtype).removeprefix("torch.") != lt.dtype:
            raise InvalidInput(f"local tensor {name} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, "
                               f"the layout says {lt.dtype} {list(lt.shape)}")
    devices = {t.device for t in tensors.values()}  # type: ignore[union-attr]
    if len(devices) > 1:
        raise InvalidInput(f"local tensors sit on several devices ({sorted(map(str, devices))}); one device per rank")
    return devices.pop() if devices else torch.device("cpu")


def _sums(share: Share, views: _Views, use_kernel: bool | None) -> torch.Tensor:
    """``[boxes, 2]`` int64 (S1, S2) of every box, on the tensors' device.  ``use_kernel``: None
    picks the kernel on CUDA with Triton; True forces it (Triton's interpreter, in the tests)."""
    if use_kernel is None:
        use_kernel = views.device.type == "cuda" and triton_importable("checksums on CUDA use the torch path")
    if use_kernel:
        out = _sums_kernel(share, views)
        if out is not None:
            return out
    return _sums_torch(share, views)


# ------------------------------------------------------------------------------------------------
# The torch path (the reference; CPU)


def _block_sums(v: torch.Tensor, box: Index, box_start: Index, chunk: int) -> torch.Tensor:
    """(S1, S2) of one block ``v`` (integers, the box's ndim) lying at ``box_start`` of a box of
    size ``box``: weights are the elements' row-major indices in the box, plus one."""
    out = torch.zeros(2, dtype=torch.int64, device=v.device)
    for sub_start, sub_size in split_box(((0,) * v.dim(), tuple(v.shape)), max(1, chunk)):
        x = v[slices(sub_start, sub_size)].to(torch.int64)
        w = _linear_index(box, shift(box_start, sub_start), sub_size, v.device).add_(1)
        out += torch.stack((x.sum(), (x * w).sum()))
    return out


def _sums_torch(share: Share, views: _Views, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    out = torch.zeros((len(share.boxes), 2), dtype=torch.int64, device=views.device)
    for n, box in enumerate(share.boxes):
        for b in box.blocks:
            v = views.of(b.local, len(b.size))[slices(b.local_start, b.size)]
            out[n] += _block_sums(v, box.box, b.box_start, chunk)
    return out


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
    owners: torch.Tensor  # [N] the box (its position in Share.boxes) of each item
    groups: list[_Group]
    bases: dict[int, str]  # element width -> the local tensor whose address offsets count from
    made_for: _Checked  # the tensors it was made for (their addresses)


def _sums_kernel(share: Share, views: _Views) -> torch.Tensor | None:
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


def _launches(share: Share, views: _Views) -> _Launches | None:
    """The cached launches when the very same tensors are at the same addresses, else new ones."""
    old = share.launches
    if old is not None and old.made_for is views.checked:
        return old
    made = _make_launches(share, views)
    if made is not None:
        share.launches = made
    return made


def _bases(views: _Views) -> dict[int, str] | None:
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


def _segment_table(share: Share, views: _Views, bases: dict[int, str]) -> list[list[int]]:
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


def _make_launches(share: Share, views: _Views) -> _Launches | None:
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


