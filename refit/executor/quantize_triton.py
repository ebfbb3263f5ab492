"""The Triton kernels of per-block FP8 quantization (`refit.executor.quantize`), on CUDA.

Two kernels run one block body (``quantize_block``), so their bits are the same: one quantizes
one tensor of any strides (`refit.executor.quantize.quantize_fp8_blocks`), the other a group of
contiguous tensors of one 2-D shape whose slices' addresses it reads from int64 tables
(`refit.executor.quantize_grouped`).  Here too: whether Triton can run them on a device, and how
a block is tiled onto a program.  Apart from `refit.executor.quantize` (which describes the
reference arithmetic the kernels reproduce) because the quantizers of one tensor and of many both
launch them, and because triton is imported here, on first use (importing the quantizers must
not import it).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from refit.executor.triton_support import triton_importable

log = logging.getLogger("refit.executor")

# Largest padded block the Triton kernel holds in registers at once; larger blocks are walked in
# row slabs of at most this many elements, twice (amax, then scale and store).
_TRITON_TILE_ELEMS = 16384


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
