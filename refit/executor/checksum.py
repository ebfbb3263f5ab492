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
same-size copy's time (bench/RESULTS.md, case "Per-transfer checksums (verified refits), one H200";
`bench/probes/checksum_speed.py`).

Here: the definition, the API, one seat's boxes and the torch path.  The kernel path (its item
tables and the Triton kernel) is `refit.executor.checksum_triton`.
"""

from __future__ import annotations

import collections
import functools
import operator
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

import torch

from refit.boxes import Index, shift, split_box
from refit.errors import InvalidInput
from refit.executor.checksum_triton import _sums_kernel
from refit.executor.triton_support import triton_importable
from refit.executor.schedule import box_blocks, check_plan
from refit.executor.topology import Topology
from refit.executor.values import DEFAULT_CHUNK, _linear_index, int_view
from refit.layouts import Layout, LocalTensor, sent_tensors
from refit.layouts.quantized import DERIVED_PREFIX
from refit.plan import Plan
from refit.sides import Side
from refit.regions import Block, PieceIndex, slices
from refit.spec import ModelSpec

_M63 = (1 << 63) - 1
_W = (2 * 0x9E3779B97F4A7C15) & _M63  # twice an odd number: keeps a flipped bit's change odd
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


def share_checksums(plan: Plan, spec: ModelSpec, src_layout: Layout, dst_layout: Layout, side: Side, rank: int,
                    tensors: Mapping[str, torch.Tensor], phase: int | None = None) -> dict[int, int]:
    """Checksum of every stage-1 transfer of ``plan`` that rank ``rank`` of ``side`` (a trainer or
    an engine) sends or receives, by its index in ``plan.transfers``.  ``tensors``: that rank's
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
    launches: Any = field(default=None, repr=False)  # `checksum_triton._Launches`, for the tensors seen last
    checked: _Checked | None = field(default=None, repr=False)  # the tensors checked last

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """The local tensors the boxes lie in, in order of first use."""
        return tuple(dict.fromkeys(b.local for box in self.boxes for b in box.blocks))


_shares: collections.OrderedDict[tuple[Any, ...], Share] = collections.OrderedDict()
_lock = threading.Lock()


def _share(plan: Plan, spec: ModelSpec, src: Layout, dst: Layout, side: Side, rank: int,
           phase: int | None = None) -> Share:
    if not isinstance(side, Side):  # a bare "trainer" would key the cache apart from Side.TRAINER
        raise InvalidInput(f"side must be a refit.sides.Side, not {side!r}")
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


def _make_share(plan: Plan, spec: ModelSpec, src: Layout, dst: Layout, side: Side, rank: int,
                phase: int | None = None) -> Share:
    check_plan(plan, spec, src, dst, Topology.one_per_rank(plan.placement))
    sending = side is Side.TRAINER
    ranks = len(plan.placement.src_gpus if sending else plan.placement.dst_gpus)
    if not 0 <= rank < ranks:
        raise InvalidInput(f"plan {plan.plan_hash} has {ranks} {side.value} ranks; there is no rank {rank}")
    if plan.gathers:
        raise InvalidInput(f"plan {plan.plan_hash} gathers whole tensors on source roots (planner {plan.planner}): "
                           "its boxes leave from gathered copies no seat holds, so its transfers have no checksums")
    locals_ = sent_tensors(spec, src if sending else dst, rank)
    index, ep = PieceIndex(locals_), (side, rank)
    wanted = range(len(plan.transfers)) if phase is None else _phase_transfers(plan, phase)
    boxes = tuple(BoxBlocks(i, t.size, tuple(box_blocks(index, t, ep, whole=True, sending=sending)))
                  for i, t in ((i, plan.transfers[i]) for i in wanted)
                  if t.stage == 1 and (t.sender if sending else t.receiver) == rank)
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
