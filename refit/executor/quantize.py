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

Here: the checks, the quantizers of one tensor (the torch path, and the launch of the Triton
kernel), `dequantize_fp8_blocks` and `quantize` by format name.  The Triton kernels themselves are
in `refit.executor.quantize_triton`; many tensors at once, the executor's path each refit
(`quantize_fp8_blocks_many`, `quantize_many`), in `refit.executor.quantize_grouped`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from refit.errors import InvalidInput
from refit.executor.quantize_triton import _num_warps, _tiling, _triton_kernels, _triton_usable
from refit.quantization import FORMATS, scale_shape

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
# The Triton path (CUDA): one launch of `refit.executor.quantize_triton`'s kernel


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
# By format name (`refit.quantization.FORMATS`): what reshard and the bench call (many tensors at
# once: `refit.executor.quantize_grouped.quantize_many`)


def quantize(fmt: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` quantized in format ``fmt`` (``fp8``: 128x128 blocks; ``mxfp8``): (values, scales)."""
    if fmt == "fp8":
        return quantize_fp8_blocks(x, FP8_BLOCK)
    if fmt == "mxfp8":
        return quantize_mxfp8(x)
    raise InvalidInput(f"no quantizer for format {fmt!r}")


__all__ = ["FP8_BLOCK", "FP8_DTYPE", "FP8_MAX", "dequantize_fp8_blocks", "fp8_scale_shape", "quantize",
           "quantize_fp8_blocks", "quantize_mxfp8"]
