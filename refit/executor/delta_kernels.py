"""Triton kernels of the delta codec (`refit.executor.delta`) on CUDA: the same payloads as its
torch path, in fewer passes over memory.

Encode is two kernels around one host sync.  ``_count`` reads the new and the last bytes of a
bucket once, block by block, writes each block's bit mask (a bit per word, the MASK payload's
own layout) to a scratch and its count of changed words; an exclusive scan of the counts (torch,
one small tensor) gives each block where its values go, and its total sizes the message.  Then
``_gather`` reads the mask and the changed words of ``new`` and writes them compacted (and, for
INDEX, their positions); the slots come from a scan within rows of 32 words, then over the rows.  About three bucket-reads in all, against the torch path's compare,
``nonzero``, packing and ``index_select`` (each a pass, several of them over int64 temporaries).
Decoding a MASK payload is the mirror: each block counts its mask's bits, a scan, then ``_scatter``
writes the values where the bits say.  An INDEX payload decodes with torch's ``index_copy_``,
already one pass over few elements.

Tested against the torch path on CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Words per program (a multiple of 64: each block's mask is whole 8-byte words), rows of the scans,
# warps: the fastest of those tried on an H200 (bench/probes/delta_kernels_tune.py, 2026-11-29).
BLOCK, ROW, WARPS_COUNT, WARPS_SCAN = 2048, 32, 4, 2


@triton.jit
def _count(new_ptr, last_ptr, mask_ptr, counts_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    a = tl.load(new_ptr + offs, mask=inside, other=0)
    b = tl.load(last_ptr + offs, mask=inside, other=0)
    d = ((a != b) & inside).to(tl.int32)
    tl.store(counts_ptr + pid, tl.sum(d, axis=0))
    bits = tl.reshape(d, (BLOCK // 8, 8)) << tl.arange(0, 8)[None, :]
    tl.store(mask_ptr + pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8), tl.sum(bits, axis=1).to(tl.uint8))


@triton.jit
def _row_flags(mask_ptr, nmask, pid, n, BLOCK: tl.constexpr, ROW: tl.constexpr):
    """The block's words as rows of ROW (their offsets) and their changed flags (int32) from the
    bit mask (``nmask`` bytes: a payload's mask ends before the last block's would)."""
    r = tl.arange(0, BLOCK // ROW)[:, None]
    j = tl.arange(0, ROW)[None, :]
    offs = pid * BLOCK + r * ROW + j
    at = pid * (BLOCK // 8) + r * (ROW // 8) + j // 8
    byte = tl.load(mask_ptr + at, mask=at < nmask, other=0).to(tl.int32)
    d = tl.where(offs < n, (byte >> (j % 8)) & 1, 0)
    return offs, d


@triton.jit
def _slots(starts_ptr, pid, d):
    """Where each changed word of the block goes among the changed words of the bucket: a scan
    within each row, then over the rows' totals (cheaper than one scan over the block)."""
    rows = tl.sum(d, axis=1)
    return tl.load(starts_ptr + pid) + (tl.cumsum(rows, axis=0) - rows)[:, None] + tl.cumsum(d, axis=1) - d


@triton.jit
def _gather(new_ptr, mask_ptr, starts_ptr, vals_ptr, pos_ptr, n, nmask, WRITE_POS: tl.constexpr,
            BLOCK: tl.constexpr, ROW: tl.constexpr):
    pid = tl.program_id(0)
    offs, d = _row_flags(mask_ptr, nmask, pid, n, BLOCK, ROW)
    at = _slots(starts_ptr, pid, d)
    changed = d != 0
    tl.store(vals_ptr + at, tl.load(new_ptr + offs, mask=changed, other=0), mask=changed)
    if WRITE_POS:
        tl.store(pos_ptr + at, offs, mask=changed)


@triton.jit
def _popcount(mask_ptr, counts_ptr, nmask, n, BLOCK: tl.constexpr, ROW: tl.constexpr):
    pid = tl.program_id(0)
    _, d = _row_flags(mask_ptr, nmask, pid, n, BLOCK, ROW)
    tl.store(counts_ptr + pid, tl.sum(tl.sum(d, axis=1), axis=0))


@triton.jit
def _scatter(cur_ptr, mask_ptr, starts_ptr, vals_ptr, n, nmask, BLOCK: tl.constexpr, ROW: tl.constexpr):
    pid = tl.program_id(0)
    offs, d = _row_flags(mask_ptr, nmask, pid, n, BLOCK, ROW)
    at = _slots(starts_ptr, pid, d)
    changed = d != 0
    tl.store(cur_ptr + offs, tl.load(vals_ptr + at, mask=changed, other=0), mask=changed)


def _starts(counts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Exclusive scan of per-block counts, and their total (the host sync)."""
    ends = torch.cumsum(counts, 0)
    return ends - counts, int(ends[-1].item()) if ends.numel() else 0


def count_changed(a: torch.Tensor, b: torch.Tensor, scratch_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pass 1 of an encode: ``a`` and ``b`` are the new and last words (one integer dtype).
    Fills ``scratch_mask`` (uint8, at least `blocks` * BLOCK / 8 bytes) with the bit mask;
    returns (the mask's bytes, each block's start among the changed words, how many changed)."""
    n = a.numel()
    blocks = triton.cdiv(n, BLOCK)
    counts = torch.empty(blocks, dtype=torch.int32, device=a.device)
    mask = scratch_mask[:blocks * (BLOCK // 8)]
    _count[(blocks,)](a, b, mask, counts, n, BLOCK=BLOCK, num_warps=WARPS_COUNT)
    starts, changed = _starts(counts)
    return mask, starts, changed


def gather(a: torch.Tensor, mask: torch.Tensor, starts: torch.Tensor, vals: torch.Tensor,
           pos: torch.Tensor | None) -> None:
    """Pass 2: the changed words of ``a`` into ``vals`` (and their positions into ``pos``, int32)."""
    n = a.numel()
    _gather[(triton.cdiv(n, BLOCK),)](a, mask, starts, vals, pos if pos is not None else vals, n, mask.numel(),
                                      WRITE_POS=pos is not None, BLOCK=BLOCK, ROW=ROW, num_warps=WARPS_SCAN)


def scatter_masked(cur: torch.Tensor, mask: torch.Tensor, vals: torch.Tensor) -> int:
    """Decode a MASK payload (its ``mask`` bytes and ``vals`` words) into ``cur`` (words).
    Returns how many words it wrote."""
    n = cur.numel()
    blocks = triton.cdiv(n, BLOCK)
    counts = torch.empty(blocks, dtype=torch.int32, device=cur.device)
    _popcount[(blocks,)](mask, counts, mask.numel(), n, BLOCK=BLOCK, ROW=ROW, num_warps=WARPS_SCAN)
    starts, changed = _starts(counts)
    _scatter[(blocks,)](cur, mask, starts, vals, n, mask.numel(), BLOCK=BLOCK, ROW=ROW, num_warps=WARPS_SCAN)
    return changed
