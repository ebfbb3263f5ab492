"""Quantizing many tensors at once: the executor quantizes a wire's weights each refit this way.

A trainer's shard holds thousands of small weights, and one kernel launch each costs more than
their bytes.  `quantize_fp8_blocks_many` groups the tensors by device, dtype and 2-D shape, and
launches `refit.executor.quantize_triton`'s grouped kernel once per group over address tables
built on the first call and kept (a small cache) while the same tensors come back at the same
addresses; `quantize_many` does the same by format name.  Per tensor, the contract and the bits
are those of `refit.executor.quantize`.  Apart from that module because the grouping, the tables
and their cache are launch bookkeeping for the executor's hot path, built on top of the
quantizers of one tensor, which need none of it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import operator
import threading
import weakref
from typing import Any, Callable, Sequence

import torch

from refit.errors import InvalidInput
from refit.executor.quantize import (AMAX_MIN, FP8_BLOCK, FP8_DTYPE, FP8_MAX, _check_block, _check_input, _check_out,
                                     fp8_scale_shape, quantize, quantize_fp8_blocks)
from refit.executor.quantize_triton import _num_warps, _tiling, _triton_kernels, _triton_usable

# Programs of one launch of the grouped kernel (a CUDA grid's first dim); larger groups take more.
_MAX_PROGRAMS = 2 ** 31 - 1


def quantize_fp8_blocks_many(xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                             scales: Sequence[torch.Tensor], block: tuple[int, int] = FP8_BLOCK) -> None:
    """Quantize every ``xs[i]`` into ``outs[i]`` and ``scales[i]``: per tensor the contract and
    the bits of ``quantize_fp8_blocks(xs[i], block, out=outs[i], scale_out=scales[i])``, with few
    kernel launches (a trainer's shard holds thousands of small weights: one launch each costs
    more than their bytes).

    On CUDA with Triton, tensors are grouped by device, input dtype and the last two dims (leading
    dims are more 2-D slices of the group) when the input, its output and its scales are all
    contiguous; each group is one launch of a kernel that reads its slices' addresses from int64
    tables on the device.  The checks, the grouping and the tables are done on the first call and
    reused while the same tensor objects come back at the same addresses (a small LRU; the
    executor quantizes the same weights into the same wire buffers every refit): a call then costs
    a launch per group and well under a microsecond of host time per tensor.  Other members, and everything
    off CUDA, go through `quantize_fp8_blocks` one by one.  Every member is checked before any is
    written: a non-tensor, an input of another dtype or fewer than 2 dims, outputs or scales of
    the wrong shape, dtype or device, or lists of different lengths are refused
    (`refit.errors.InvalidInput`) naming the index.  The tensors must stay alive until the
    launched kernels have run, as for any CUDA operation.
    """
    bm, bn = _check_block(block)
    xs, outs, scales = (v if isinstance(v, (list, tuple)) else list(v) for v in (xs, outs, scales))
    if not len(xs) == len(outs) == len(scales):
        raise InvalidInput(f"quantize_fp8_blocks_many: {len(xs)} inputs, {len(outs)} outs and {len(scales)} scales: "
                           "one output and one scale tensor per input")
    if not xs:
        return
    flat = [*xs, *outs, *scales]
    key = _many_key((bm, bn), flat)
    plan = _many_lookup(key, flat)
    if plan is None:
        plan = _many_plan(xs, outs, scales, (bm, bn))  # checks every member first
        if plan.groups:
            _many_remember(key, flat, plan)
    _many_run(plan, xs, outs, scales, (bm, bn))


# ------------------------------------------------------------------------------------------------
# The grouping, its address tables and their cache (CUDA)

@dataclasses.dataclass
class _ManyGroup:
    """One launch (more only past the grid's 2**31 programs) over slices of one 2-D shape."""
    device: torch.device
    members: list[int]  # indices; the table holds offsets from the first's tensors (no tensor is kept)
    tables: torch.Tensor  # [3, slices] int64 on the device: input, FP8 and scale offsets
    launches: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]  # (programs, three table rows)
    args: tuple[int, int, int, int]  # R, C, NBR, NBC
    consts: dict[str, Any]
    num_warps: int
    stream: Any  # the stream the tables were allocated on (None on the CPU)


@dataclasses.dataclass
class _ManyPlan:
    groups: list[_ManyGroup]
    loop: list[int]  # members quantized one call each (non-contiguous, or not on a Triton GPU)


@dataclasses.dataclass
class _ManyEntry:
    """A cached plan and what it was made for: the very tensor objects (weakly held: the cache
    keeps no buffer alive) at the very addresses."""
    plan: _ManyPlan
    refs: tuple[weakref.ref, ...]
    ptrs: tuple[int, ...]


# Plans kept for the member lists seen last: the executor sends the same buffers every refit.
_MANY_CACHE_SIZE = 4
_many_cache: collections.OrderedDict[tuple[Any, ...], _ManyEntry] = collections.OrderedDict()
_many_lock = threading.Lock()
# Pointer tables built so far (a tensor per group; tests count them to see the cache work).
_many_stats = {"tables_built": 0}
_DEREF = weakref.ref.__call__


def _many_key(block: tuple[int, int], flat: Sequence[Any]) -> tuple[Any, ...]:
    """The cache's key: the block and every member's object id, inputs, outputs, scales."""
    return (block, *map(id, flat))


def _many_lookup(key: tuple[Any, ...], flat: Sequence[Any]) -> _ManyPlan | None:
    """The plan made for these very tensor objects, if they still hold the same addresses.

    A hit costs well under a microsecond a tensor (the checks and the grouping several): object
    identity through weak references (an id alone may be reused once its tensor is freed), then
    every address.  What the identity does not cover is a tensor whose metadata is changed in
    place at the same address (``resize_``, ``as_strided_``): don't, between calls."""
    with _many_lock:
        entry = _many_cache.get(key)
    if entry is None:
        return None
    if not all(map(operator.is_, map(_DEREF, entry.refs), flat)):
        return None
    try:
        if tuple(map(torch.Tensor.data_ptr, flat)) != entry.ptrs:
            return None
    except (TypeError, RuntimeError):  # not tensors (the checks will say so)
        return None
    with _many_lock:
        if key in _many_cache:
            _many_cache.move_to_end(key)
    return entry.plan


def _many_remember(key: tuple[Any, ...], flat: Sequence[torch.Tensor], plan: _ManyPlan) -> None:
    entry = _ManyEntry(plan, tuple(map(weakref.ref, flat)), tuple(map(torch.Tensor.data_ptr, flat)))
    with _many_lock:
        _many_cache[key] = entry
        _many_cache.move_to_end(key)
        while len(_many_cache) > _MANY_CACHE_SIZE:
            _many_cache.popitem(last=False)


def _many_check(xs: Sequence[Any], outs: Sequence[Any], scales: Sequence[Any], block: tuple[int, int]) -> None:
    """Every member's checks, before anything is launched."""
    for i, (x, q, s) in enumerate(zip(xs, outs, scales)):
        _check_input(x, 2, f"quantize_fp8_blocks_many: xs[{i}]")
        for t, name in ((q, "outs"), (s, "scales")):
            if not isinstance(t, torch.Tensor):
                raise InvalidInput(f"quantize_fp8_blocks_many: {name}[{i}]: expected a torch.Tensor, "
                                   f"got {type(t).__name__}")
        _check_out(q, f"quantize_fp8_blocks_many: outs[{i}]", tuple(x.shape), FP8_DTYPE, x.device)
        _check_out(s, f"quantize_fp8_blocks_many: scales[{i}]", fp8_scale_shape(x.shape, block), torch.float32,
                   x.device)


def _many_plan(xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
               block: tuple[int, int], use_kernel: Callable[[torch.Tensor], bool] | None = None) -> _ManyPlan:
    """Check every member, group those the kernel takes (``use_kernel(x)``: by default CUDA
    with a usable Triton; the tests pass CPU tensors to Triton's interpreter), build each group's
    address tables on its device."""
    _many_check(xs, outs, scales, block)
    if use_kernel is None:
        def use_kernel(x: torch.Tensor) -> bool:
            return x.is_cuda and _triton_usable(x.device)
    bm, bn = block
    members: dict[tuple[Any, ...], list[int]] = {}
    loop: list[int] = []
    for i, (x, q, s) in enumerate(zip(xs, outs, scales)):
        if x.numel() == 0:
            continue
        if not (x.is_contiguous() and q.is_contiguous() and s.is_contiguous() and use_kernel(x)):
            loop.append(i)
            continue
        r, c = x.shape[-2:]
        aligned = x.data_ptr() % 16 == 0 and q.data_ptr() % 16 == 0 and (x.ndim == 2 or r * c % 16 == 0)
        members.setdefault((x.device, x.dtype, r, c, aligned), []).append(i)
    groups = []
    for (device, dtype, r, c, aligned), idx in members.items():
        nbr, nbc = -(-r // bm), -(-c // bn)
        es, xstep, sstep = dtype.itemsize, r * c, nbr * nbc
        # Offsets from the first member's tensors, in 16 bytes where every address allows it.
        xu, qu = (16, 16) if aligned else (es, 1)
        xb, qb, sb = xs[idx[0]].data_ptr(), outs[idx[0]].data_ptr(), scales[idx[0]].data_ptr()
        xa: list[int] = []
        qa: list[int] = []
        sa: list[int] = []
        for i in idx:
            x0, q0, s0 = (xs[i].data_ptr() - xb) // xu, (outs[i].data_ptr() - qb) // qu, (scales[i].data_ptr() - sb) // 4
            n = xs[i].numel() // xstep  # 2-D slices; more than one only when r * c is a multiple of 16
            xa += [x0 + j * (xstep * es // xu) for j in range(n)]
            qa += [q0 + j * (xstep // qu) for j in range(n)]
            sa += [s0 + j * sstep for j in range(n)]
        per_launch = _MAX_PROGRAMS // sstep
        if per_launch == 0:
            raise InvalidInput(f"quantize_fp8_blocks_many: xs[{idx[0]}] has {sstep} blocks in one slice, more than "
                               f"one launch's grid ({_MAX_PROGRAMS})")
        tables = torch.tensor([xa, qa, sa], dtype=torch.int64).to(device)
        _many_stats["tables_built"] += 1
        launches = [((min(len(xa), a + per_launch) - a) * sstep, tables[0, a:a + per_launch],
                     tables[1, a:a + per_launch], tables[2, a:a + per_launch]) for a in range(0, len(xa), per_launch)]
        pbn, sub_m, n_sub, even = _tiling(block, r, c)
        consts = dict(BM=bm, BN=bn, PBN=pbn, SUB_M=sub_m, N_SUB=n_sub, EVEN=even, XSTEP=xu // es, QSTEP=qu,
                      FP8MAX=FP8_MAX, AMIN=AMAX_MIN)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        groups.append(_ManyGroup(device, idx, tables, launches, (r, c, nbr, nbc), consts,
                                 _num_warps(sub_m * pbn), stream))
    return _ManyPlan(groups, loop)


def _many_run(plan: _ManyPlan, xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
              scales: Sequence[torch.Tensor], block: tuple[int, int]) -> None:
    """One launch per group, then the members left over one call each."""
    if plan.groups:
        kernel = _triton_kernels()[1]
    for g in plan.groups:
        with torch.cuda.device(g.device) if g.stream is not None else contextlib.nullcontext():  # CPU: interpreter
            if g.stream is not None:
                stream = torch.cuda.current_stream(g.device)
                if stream != g.stream:  # keep the tables from reuse until this stream's kernels ran
                    g.tables.record_stream(stream)
            ref = g.members[0]  # the offsets' origin (its addresses are the plan's: checked or just seen)
            x_ref, q_ref, s_ref = xs[ref], outs[ref], scales[ref]
            for programs, xt, qt, st in g.launches:
                kernel[(programs,)](xt, qt, st, x_ref, q_ref, s_ref, *g.args, **g.consts, num_warps=g.num_warps,
                                    num_stages=1)
    for i in plan.loop:
        quantize_fp8_blocks(xs[i], block, out=outs[i], scale_out=scales[i])


def plan_fp8_many(xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                  scales: Sequence[torch.Tensor]) -> _ManyPlan:
    """The checks and launch tables of `quantize_fp8_blocks_many` made once, for a caller that
    keeps the same tensors and more sets of them than its cache holds (the executor's landing
    quantizer, a set per phase); made on the stream the launches will run on."""
    return _many_plan(xs, outs, scales, FP8_BLOCK)


def run_fp8_many(plan: _ManyPlan, xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                 scales: Sequence[torch.Tensor]) -> None:
    """`quantize_fp8_blocks_many` of the tensors ``plan`` was made for."""
    _many_run(plan, xs, outs, scales, FP8_BLOCK)


# ------------------------------------------------------------------------------------------------
# By format name (`refit.quantization.FORMATS`): what the executor and the bench call


def quantize_many(fmt: str, xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                  scales: Sequence[torch.Tensor]) -> None:
    """Each ``xs[i]`` quantized in format ``fmt`` into ``outs[i]`` and ``scales[i]`` (FP8: few
    launches for any number of tensors, `quantize_fp8_blocks_many`)."""
    if fmt == "fp8":
        quantize_fp8_blocks_many(xs, outs, scales, FP8_BLOCK)
        return
    for x, out, scale in zip(xs, outs, scales, strict=True):
        values, factors = quantize(fmt, x)
        out.copy_(values)
        scale.copy_(factors)


__all__ = ["plan_fp8_many", "quantize_fp8_blocks_many", "quantize_many", "run_fp8_many"]
