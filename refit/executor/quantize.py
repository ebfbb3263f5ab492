"""Quantization on the wire: the trainer turns bf16 weights into FP8 before it sends them.

An FP8 engine (vLLM with block-quantized weights) holds ``float8_e4m3fn`` values and one float32
scale per 128x128 block.  Sending the bf16 weights and letting the engine quantize costs twice
the bytes on the wire; quantizing on the trainer's side halves them, but only if the engine ends
up with exactly the bits its own quantizer would have produced (a refitted engine must equal a
freshly loaded one).  So everything here is bit-exact with vLLM's reference functions:

* `quantize_fp8_blocks` — per-block FP8 over the last two dims, the bits of
  ``vllm.utils.deep_gemm.per_block_cast_to_fp8(x2d, block_size, use_ue8m0=False)`` computed on
  the CPU, for every 2-D slice of a batched tensor (MoE experts ``[E, 2I, H]``);
* `quantize_mxfp8` — MXFP8 (1x32 blocks, e8m0 scales), the bits of vLLM's
  ``mxfp8_utils._mxfp8_e4m3_quantize_torch(x, is_sf_swizzled_layout=False)``;
* `dequantize_fp8_blocks` — the inverse of the first, for tests and documentation.

The reference's arithmetic, per block: ``amax = max|x|`` in float32, ``clamp(amax, 1e-4)``,
``sf = amax / 448`` and ``q = fp8(x * (1 / sf))``, each step one correctly rounded float32
operation.  On CUDA a Triton kernel does the same operations (IEEE division, ``div_rn``, never
the approximate one) in one pass over memory; elsewhere, or without Triton, torch does them in
bounded chunks.  The torch path divides by a 0-dim tensor, not a Python scalar: torch's CUDA
kernels turn division by a Python scalar into multiplication by its reciprocal, an ulp off for
about 30% of the scales.  vLLM's function itself runs under ``torch.compile`` (Inductor); what
this module promises is its CPU result, on every device.

Bit-exactness covers finite inputs.  NaN or infinity in a block gives NaN codes there on every
path, but the sign bit of a NaN code may differ between the CPU and the GPU.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import operator
import threading
import weakref
from typing import Any, Callable, Sequence

import torch

from refit.errors import InvalidInput
from refit.executor.triton_support import triton_importable
from refit.quantization import FORMATS, scale_shape

log = logging.getLogger("refit.executor")

FP8_MAX = 448.0
FP8_BLOCK = FORMATS["fp8"].block  # (128, 128)
FP8_DTYPE = torch.float8_e4m3fn
# The reference clamps amax with the Python float 1e-4, which torch rounds to float32 first.
AMAX_MIN = float(torch.tensor(1e-4, dtype=torch.float32).item())
MXFP8_BLOCK = 32
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements of one float32 work buffer of the torch path (two buffers of this size are live):
# bounds the path's extra memory whatever the input's size.
_CPU_CHUNK_ELEMS = 1 << 22
# Largest padded block the Triton kernel holds in registers at once; larger blocks are walked in
# row slabs of at most this many elements, twice (amax, then scale and store).
_TRITON_TILE_ELEMS = 16384
# Programs of one launch of the grouped kernel (a CUDA grid's first dim); larger groups take more.
_MAX_PROGRAMS = 2 ** 31 - 1


# ------------------------------------------------------------------------------------------------
# Checks


def _check_input(x: torch.Tensor, min_ndim: int, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise InvalidInput(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise InvalidInput(f"{what}: input dtype {x.dtype} is not one of "
                             f"{', '.join(str(d) for d in INPUT_DTYPES)}")
    if x.ndim < min_ndim:
        raise InvalidInput(f"{what}: input needs at least {min_ndim} dims, got shape {tuple(x.shape)} "
                             f"({x.ndim} dims)")


def _check_block(block: Any) -> tuple[int, int]:
    try:
        bm, bn = (int(b) for b in block)
    except (TypeError, ValueError):
        raise InvalidInput(f"block must be two positive ints, got {block!r}") from None
    if bm <= 0 or bn <= 0 or (bm, bn) != tuple(block):
        raise InvalidInput(f"block must be two positive ints, got {block!r}")
    return bm, bn


def fp8_scale_shape(shape: torch.Size | tuple[int, ...], block: tuple[int, int] = FP8_BLOCK) -> tuple[int, ...]:
    """The scale tensor's shape for values of ``shape``: one scale per (partial) block of the
    last two dims, ``(*lead, ceil(R/bm), ceil(C/bn))``."""
    block = _check_block(block)
    if len(shape) < 2:
        raise InvalidInput(f"per-block FP8 needs at least 2 dims, got shape {tuple(shape)}")
    return scale_shape(tuple(shape), block)


def _check_out(t: torch.Tensor | None, name: str, shape: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise InvalidInput(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise InvalidInput(f"{name} must be {dtype} of shape {tuple(shape)} on {device}, got {t.dtype} of shape "
                             f"{tuple(t.shape)} on {t.device}")


# ------------------------------------------------------------------------------------------------
# Per-block FP8


def quantize_fp8_blocks(x: torch.Tensor, block: tuple[int, int] = FP8_BLOCK, out: torch.Tensor | None = None,
                        scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to FP8 (e4m3fn) with one float32 scale per ``block`` of its last two dims.

    Leading dims are batched (MoE experts ``[E, 2I, H]``); blocks at the ends may be partial.
    Returns ``(values, scales)``: values of ``x``'s shape, scales of `fp8_scale_shape`; both are
    ``out`` / ``scale_out`` when given (written in place: the executor keeps its wire buffers for
    a plan's life).  Bit-exact with vLLM's ``per_block_cast_to_fp8`` on the CPU, slice by slice.
    Refuses (`refit.errors.InvalidInput`, a ValueError) inputs other than bf16/fp16/fp32 or of
    fewer than 2 dims, bad blocks, and outputs of the wrong shape, dtype or device.  Outputs whose
    leading dims do not flatten into one, and such inputs, go through a temporary copy.
    """
    _check_input(x, 2, "quantize_fp8_blocks")
    bm, bn = _check_block(block)
    sshape = fp8_scale_shape(x.shape, (bm, bn))
    _check_out(out, "out", tuple(x.shape), FP8_DTYPE, x.device)
    _check_out(scale_out, "scale_out", sshape, torch.float32, x.device)
    q = out if out is not None else torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    s = scale_out if scale_out is not None else torch.empty(sshape, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return q, s
    if x.is_cuda and _triton_usable(x.device):
        _quantize_fp8_triton(x, (bm, bn), q, s)
    else:
        _quantize_fp8_torch(x, (bm, bn), q, s)
    return q, s


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


def _as_3d(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[L, R, C]`` without copying, or None when its leading dims do not flatten."""
    r, c = t.shape[-2:]
    try:
        return t.view(-1, r, c)
    except RuntimeError:
        return None


def _slices(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x``, ``q`` and ``s`` as ``[L, R, C]`` stacks of 2-D slices; an output whose leading dims
    do not flatten gets a temporary (`_write_back` copies it over)."""
    r, c = x.shape[-2:]
    x3 = x.reshape(-1, r, c)
    q3, s3 = _as_3d(q), _as_3d(s)
    q_out = q3 if q3 is not None else torch.empty(x3.shape, dtype=FP8_DTYPE, device=x.device)
    s_out = s3 if s3 is not None else torch.empty((x3.shape[0], *s.shape[-2:]), dtype=torch.float32, device=x.device)
    return x3, q_out, s_out


def _write_back(q: torch.Tensor, s: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """Copy `_slices`' temporaries into the real outputs (nothing where the outputs were used)."""
    if q_out.data_ptr() != q.data_ptr():
        q.copy_(q_out.view(q.shape))
    if s_out.data_ptr() != s.data_ptr():
        s.copy_(s_out.view(s.shape))


def _quantize_fp8_torch(x: torch.Tensor, block: tuple[int, int], q: torch.Tensor, s: torch.Tensor) -> None:
    """The reference's operations on slabs of whole block rows: two float32 work buffers of at
    most `_CPU_CHUNK_ELEMS` elements, whatever the input's size."""
    bm, bn = block
    r, c = x.shape[-2:]
    nbr, nbc = s.shape[-2:]
    x3, q_out, s_out = _slices(x, q, s)
    leads = x3.shape[0]
    cp = nbc * bn
    slice_elems = nbr * bm * cp
    if slice_elems <= _CPU_CHUNK_ELEMS:  # whole slices, as many as fit
        lpc, bpc = min(leads, max(1, _CPU_CHUNK_ELEMS // slice_elems)), nbr
    else:  # one slice at a time, in slabs of block rows
        lpc, bpc = 1, max(1, _CPU_CHUNK_ELEMS // (bm * cp))
    # Zeroed once: the padding columns are never written, so they stay zero (they cannot raise an
    # amax of |x|); padding rows of a partial last block row are zeroed where they occur.
    buf = torch.zeros((lpc, bpc * bm, cp), dtype=torch.float32, device=x.device)
    absbuf = torch.empty_like(buf)
    # A tensor divisor: torch divides exactly by it on every device (a Python scalar becomes a
    # multiplication by its reciprocal on CUDA).
    fp8_max = torch.full((), FP8_MAX, dtype=torch.float32, device=x.device)
    for l0 in range(0, leads, lpc):
        nl = min(lpc, leads - l0)
        for b0 in range(0, nbr, bpc):
            nb = min(bpc, nbr - b0)
            r0, r1 = b0 * bm, min(r, (b0 + nb) * bm)
            work = buf[:nl, :nb * bm]  # contiguous: nl < lpc only with nb == bpc == nbr, and vice versa
            work[:, :r1 - r0, :c].copy_(x3[l0:l0 + nl, r0:r1])
            if r1 - r0 < nb * bm:
                work[:, r1 - r0:].zero_()
            blocks = work.view(nl, nb, bm, nbc, bn)
            absb = absbuf[:nl, :nb * bm].view(nl, nb, bm, nbc, bn)
            torch.abs(blocks, out=absb)
            amax = absb.amax(dim=(2, 4)).clamp(AMAX_MIN)  # [nl, nb, nbc]
            sf = amax / fp8_max
            blocks.mul_(torch.reciprocal(sf)[:, :, None, :, None])  # the reference's x * (1.0 / sf)
            q_out[l0:l0 + nl, r0:r1].copy_(work[:, :r1 - r0, :c])
            s_out[l0:l0 + nl, b0:b0 + nb].copy_(sf)
    _write_back(q, s, q_out, s_out)


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` with each scale spread over its block, in ``dtype``: what an FP8 engine's
    GEMM sees of the weight (for tests and documentation; not on any hot path)."""
    bm, bn = _check_block(block)
    if q.dtype != FP8_DTYPE:
        raise InvalidInput(f"dequantize_fp8_blocks: values must be {FP8_DTYPE}, got {q.dtype}")
    sshape = fp8_scale_shape(q.shape, (bm, bn))
    if tuple(scale.shape) != sshape:
        raise InvalidInput(f"dequantize_fp8_blocks: scale shape {tuple(scale.shape)} does not fit values of shape "
                             f"{tuple(q.shape)} in blocks of {(bm, bn)} (expected {sshape})")
    r, c = q.shape[-2:]
    full = scale.to(torch.float32).repeat_interleave(bm, dim=-2)[..., :r, :].repeat_interleave(bn, dim=-1)[..., :c]
    return (q.to(torch.float32) * full).to(dtype)


# ------------------------------------------------------------------------------------------------
# The Triton kernel (CUDA)


_fp8_quantize_block: Any = None  # set by _triton_kernels


@functools.lru_cache(maxsize=None)
def _triton_kernels() -> tuple[Any, Any]:
    """The kernels, compiled on first use: importing this module must not import triton.

    ``fp8_block_kernel`` quantizes one tensor (any strides); ``fp8_block_many_kernel`` a group of
    contiguous tensors of one 2-D shape and dtype, its slices' addresses read from int64 tables.
    Both run the same block body (``quantize_block``), so their bits are the same."""
    global _fp8_quantize_block
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_block(xb, qb, sp, rows_left, cols_left, sxr, sxc, sqr, sqc,
                       BM: tl.constexpr, BN: tl.constexpr, PBN: tl.constexpr, SUB_M: tl.constexpr,
                       N_SUB: tl.constexpr, EVEN: tl.constexpr, FP8MAX: tl.constexpr, AMIN: tl.constexpr):
        # One block: values from xb (row stride sxr, column stride sxc), FP8 codes to qb, its
        # scale to sp.
        rows = tl.arange(0, SUB_M)
        cols = tl.arange(0, PBN)
        if N_SUB == 1:
            # The whole block in registers, in the input dtype: one read, one write.
            if EVEN:
                x = tl.load(xb + rows[:, None] * sxr + cols[None, :] * sxc)
            else:
                m = ((rows < BM) & (rows < rows_left))[:, None] & ((cols < BN) & (cols < cols_left))[None, :]
                x = tl.load(xb + rows[:, None] * sxr + cols[None, :] * sxc, mask=m, other=0.0)
            amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0).to(tl.float32)
        else:
            acc = tl.zeros([SUB_M], dtype=tl.float32)
            for i in range(N_SUB):
                rr = i * SUB_M + rows
                m = ((rr < BM) & (rr < rows_left))[:, None] & ((cols < BN) & (cols < cols_left))[None, :]
                xi = tl.load(xb + rr[:, None] * sxr + cols[None, :] * sxc, mask=m, other=0.0)
                acc = tl.maximum(acc, tl.max(tl.abs(xi), axis=1).to(tl.float32))
            amax = tl.max(acc, axis=0)
        amax = tl.maximum(amax, AMIN)
        sf = tl.math.div_rn(amax, tl.full([], FP8MAX, tl.float32))
        inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), sf)
        if N_SUB == 1:
            y = (x.to(tl.float32) * inv).to(tl.float8e4nv, fp_downcast_rounding="rtne")
            if EVEN:
                tl.store(qb + rows[:, None] * sqr + cols[None, :] * sqc, y)
            else:
                tl.store(qb + rows[:, None] * sqr + cols[None, :] * sqc, y, mask=m)
        else:
            for i in range(N_SUB):
                rr = i * SUB_M + rows
                m = ((rr < BM) & (rr < rows_left))[:, None] & ((cols < BN) & (cols < cols_left))[None, :]
                xi = tl.load(xb + rr[:, None] * sxr + cols[None, :] * sxc, mask=m, other=0.0)
                yi = (xi.to(tl.float32) * inv).to(tl.float8e4nv, fp_downcast_rounding="rtne")
                tl.store(qb + rr[:, None] * sqr + cols[None, :] * sqc, yi, mask=m)
        tl.store(sp, sf)

    # The kernels call the block body by its module-level name: Triton's interpreter re-executes a
    # kernel's source with its module's globals, without the closure.
    _fp8_quantize_block = quantize_block

    @triton.jit
    def fp8_block_kernel(x_ptr, q_ptr, s_ptr, R, C, NBR, NBC,
                         sxl, sxr, sxc, sql, sqr, sqc, ssl, ssr, ssc,
                         BM: tl.constexpr, BN: tl.constexpr, PBN: tl.constexpr, SUB_M: tl.constexpr,
                         N_SUB: tl.constexpr, EVEN: tl.constexpr,
                         FP8MAX: tl.constexpr, AMIN: tl.constexpr):
        # One program per block; block columns vary fastest, so neighbours read neighbouring memory.
        pid = tl.program_id(0)
        bc = pid % NBC
        t = pid // NBC
        br = t % NBR
        lead = (t // NBR).to(tl.int64)
        row0 = br.to(tl.int64) * BM
        col0 = bc.to(tl.int64) * BN
        _fp8_quantize_block(x_ptr + lead * sxl + row0 * sxr + col0 * sxc, q_ptr + lead * sql + row0 * sqr + col0 * sqc,
                       s_ptr + lead * ssl + br * ssr + bc * ssc, R - row0, C - col0, sxr, sxc, sqr, sqc,
                       BM, BN, PBN, SUB_M, N_SUB, EVEN, FP8MAX, AMIN)

    @triton.jit
    def fp8_block_many_kernel(x_tab, q_tab, s_tab, x_ref, q_ref, s_ref, R, C, NBR, NBC,
                              BM: tl.constexpr, BN: tl.constexpr, PBN: tl.constexpr, SUB_M: tl.constexpr,
                              N_SUB: tl.constexpr, EVEN: tl.constexpr, XSTEP: tl.constexpr, QSTEP: tl.constexpr,
                              FP8MAX: tl.constexpr, AMIN: tl.constexpr):
        # One program per block of every slice of the group.  Slice ``sl``'s contiguous [R, C]
        # input, FP8 output and [NBR, NBC] scales start at ``x_ref + x_tab[sl] * XSTEP`` elements
        # (likewise q, s): offsets from one member's tensors, in units of XSTEP elements, so that
        # the compiler sees 16-byte alignment (XSTEP * element size = 16 when every address of the
        # group allows it) and loads and stores 16 bytes at a time.
        pid = tl.program_id(0)
        bc = pid % NBC
        t = pid // NBC
        br = t % NBR
        sl = t // NBR
        xp = x_ref + tl.load(x_tab + sl) * XSTEP
        qp = q_ref + tl.load(q_tab + sl) * QSTEP
        sp = s_ref + tl.load(s_tab + sl)
        row0 = br.to(tl.int64) * BM
        col0 = bc.to(tl.int64) * BN
        off = row0 * C + col0
        _fp8_quantize_block(xp + off, qp + off, sp + br * NBC + bc, R - row0, C - col0, C, 1, C, 1,
                            BM, BN, PBN, SUB_M, N_SUB, EVEN, FP8MAX, AMIN)

    return fp8_block_kernel, fp8_block_many_kernel




@functools.lru_cache(maxsize=None)
def _triton_usable(device: torch.device) -> bool:
    """Triton converts to e4m3fn in hardware from compute capability 8.9 (Ada, Hopper) on."""
    if not triton_importable("FP8 quantization on CUDA uses the torch path"):
        return False
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        log.warning("GPU %s has compute capability %d.%d (< 8.9, no FP8 conversion): FP8 quantization uses the "
                    "torch path", device, *cap)
        return False
    return True


def _num_warps(tile_elems: int) -> int:
    """Warps per program: 64 elements per thread (eight 16-byte loads of bf16 in flight each),
    at most 8 warps, so a 128x128 block keeps 256 threads busy and a small block one warp."""
    return max(1, min(8, tile_elems // 2048))


def _tiling(block: tuple[int, int], r: int, c: int) -> tuple[int, int, int, bool]:
    """The kernels' tiling of a block of an ``[r, c]`` slice: ``(PBN, SUB_M, N_SUB, EVEN)``, the
    block's columns padded to a power of two, the rows of one register tile, the tiles per block,
    and whether no mask is needed."""
    bm, bn = block
    pbm, pbn = 1 << (bm - 1).bit_length(), 1 << (bn - 1).bit_length()
    sub_m = max(1, min(pbm, _TRITON_TILE_ELEMS // pbn))
    n_sub = pbm // sub_m
    even = n_sub == 1 and pbm == bm and pbn == bn and r % bm == 0 and c % bn == 0
    return pbn, sub_m, n_sub, even


def _quantize_fp8_triton(x: torch.Tensor, block: tuple[int, int], q: torch.Tensor, s: torch.Tensor,
                         num_warps: int | None = None) -> None:
    """Launch the kernel over every block (``num_warps`` overrides the heuristic: for tuning)."""
    bm, bn = block
    r, c = x.shape[-2:]
    nbr, nbc = s.shape[-2:]
    x3, q_out, s_out = _slices(x, q, s)
    pbn, sub_m, n_sub, even = _tiling((bm, bn), r, c)
    programs = x3.shape[0] * nbr * nbc
    if programs >= 2 ** 31:
        raise InvalidInput(f"quantize_fp8_blocks: {programs} blocks exceed one launch's grid (2**31 - 1)")
    kernel = _triton_kernels()[0]
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # CPU: the interpreter
        kernel[(programs,)](
            x3, q_out, s_out, r, c, nbr, nbc,
            *x3.stride(), *q_out.stride(), *s_out.stride(),
            BM=bm, BN=bn, PBN=pbn, SUB_M=sub_m, N_SUB=n_sub, EVEN=even,
            FP8MAX=FP8_MAX, AMIN=AMAX_MIN,
            num_warps=num_warps or _num_warps(sub_m * pbn), num_stages=1,
        )
    _write_back(q, s, q_out, s_out)


# ------------------------------------------------------------------------------------------------
# Many tensors, grouped (CUDA)

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


# ------------------------------------------------------------------------------------------------
# MXFP8


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to MXFP8: e4m3fn values, one e8m0 scale (uint8, biased exponent) per 32
    elements of the last dim, scales shaped ``(*x.shape[:-1], K // 32)``.

    Bit-exact with vLLM's ``_mxfp8_e4m3_quantize_torch(x, is_sf_swizzled_layout=False)`` on the
    same device: the same torch operations, the elementwise ones on row chunks (extra memory
    bounded), the scale's ``log2`` on the whole amax tensor at once as the reference does (torch's
    vectorized and scalar ``log2`` may disagree by an ulp, so the loop split must be the same).
    """
    _check_input(x, 1, "quantize_mxfp8")
    k = x.shape[-1]
    if k % MXFP8_BLOCK:
        raise InvalidInput(f"quantize_mxfp8: the last dim ({k}) must be a multiple of {MXFP8_BLOCK}, "
                             f"shape {tuple(x.shape)}")
    nb = k // MXFP8_BLOCK
    x2 = x.reshape(-1, k)
    n = x2.shape[0]
    rows = max(1, _CPU_CHUNK_ELEMS // max(k, 1))
    amax = torch.empty((n, nb), dtype=torch.float32, device=x.device)
    for r0 in range(0, n, rows):
        xc = x2[r0:r0 + rows].to(torch.float32)
        torch.amax(xc.view(-1, nb, MXFP8_BLOCK).abs(), dim=-1, out=amax[r0:r0 + rows])
    amax = amax.clamp(min=torch.finfo(torch.float32).tiny)
    fp8_max = torch.finfo(FP8_DTYPE).max
    scale_biased = torch.ceil(torch.log2(amax / fp8_max)) + 127.0
    scale_biased = scale_biased.clamp(0, 254)
    scales = scale_biased.to(torch.uint8)
    descale = torch.exp2(scale_biased - 127.0)
    q = torch.empty((n, k), dtype=FP8_DTYPE, device=x.device)
    for r0 in range(0, n, rows):
        xc = x2[r0:r0 + rows].to(torch.float32).view(-1, nb, MXFP8_BLOCK)
        q[r0:r0 + rows].copy_((xc / descale[r0:r0 + rows].unsqueeze(-1)).view(-1, k))
    return q.view(x.shape), scales.view(*x.shape[:-1], nb)


# ------------------------------------------------------------------------------------------------
# By format name (`refit.quantization.FORMATS`): what the executor, the bench and reshard call


def quantize(fmt: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` quantized in format ``fmt`` (``fp8``: 128x128 blocks; ``mxfp8``): (values, scales)."""
    if fmt == "fp8":
        return quantize_fp8_blocks(x, FP8_BLOCK)
    if fmt == "mxfp8":
        return quantize_mxfp8(x)
    raise InvalidInput(f"no quantizer for format {fmt!r}")


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


__all__ = ["FP8_BLOCK", "FP8_DTYPE", "FP8_MAX", "dequantize_fp8_blocks", "fp8_scale_shape", "quantize",
           "quantize_fp8_blocks", "quantize_fp8_blocks_many", "quantize_many", "quantize_mxfp8"]
