"""A trainer's local tensors that cut FP8 blocks, quantized with block scales shared across ranks.

FSDP2 ``fsdp:dp8`` holds 64 rows of a 512-row ``k_proj``: each 128x128 block lies on two ranks,
and neither can compute the block's scale alone.  The layout (`refit.layouts.quantized`) keeps
such a local tensor unquantized and names the tensors derived from it — float8 values of its
shape, and per piece the scales of the blocks it touches, of which it sends those it owns.  Each
refit, after the start barrier, `Member` runs this (`share`):

1. `SharedQuantizer.partial_amax`: every rank's ``max|x|`` over its part of each block, into a
   table laid out per canonical scale tensor (`refit.layouts.quantized.scale_table`);
2. the members all-reduce the table with MAX on the control group (every member, in lockstep;
   those holding no such tensor add zeros): the maximum of the parts' maxima is the block's amax;
3. `SharedQuantizer.quantize`: each rank quantizes its own elements with its blocks' scales.

The arithmetic is `refit.executor.quantize`'s torch path (vLLM's ``per_block_cast_to_fp8``):
``clamp(amax, 1e-4) / 448`` divided by a tensor, then ``x * reciprocal(scale)`` in float32 and a
cast to float8 — elementwise once the scale is known, so a rank's part gets exactly the bits a
quantization of the whole tensor gives it.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Iterator, Mapping, NamedTuple

import torch

from refit.executor.values import TORCH_DTYPES
from refit.executor.quantize import AMAX_MIN, FP8_MAX
from refit.layouts import LocalTensor, Piece
from refit.layouts.quantized import QuantizedLayout, SharedBlocks, TableEntry
from refit.quantization import quant_format
from refit.regions import slices
from refit.spec import ModelSpec

# Elements of one chunk's float32 work buffer (256 MiB; a copy of the slices padded to whole
# blocks): bounds the extra memory whatever the number of cut tensors.
_CHUNK_ELEMS = 1 << 26


def allocate_derived(spec: ModelSpec, layout: QuantizedLayout, rank: int,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """Zeroed tensors for what ``rank`` derives from its cut local tensors (none where nothing is cut)."""
    return {lt.name: torch.zeros(lt.shape, dtype=TORCH_DTYPES[lt.dtype], device=device)
            for lt in layout.derived_tensors(spec, rank)}


def share(shared: "SharedQuantizer", device: torch.device, all_reduce_max: Callable[[torch.Tensor], None]) -> None:
    """One rank's turn of the three steps above: its partial amaxes, all-reduced with MAX over
    every rank on the host (``all_reduce_max``, in place: `Member`'s control group), then its own
    elements quantized with the blocks' scales."""
    host = shared.partial_amax(device).cpu()
    all_reduce_max(host)
    shared.quantize(host.to(device))


class _Group(NamedTuple):
    """2-D slices of cut local tensors with one geometry (canonical scale tensor, rows, columns,
    offsets in their first block): quantized together, in chunks."""

    sources: list[torch.Tensor]  # [rows, cols] views of the unquantized local tensors
    values: list[torch.Tensor]  # [rows, cols] views of the derived float8 values
    scales: list[torch.Tensor]  # [nbr, nbc] views of the derived scales (every block the slice touches)
    bases: list[int]  # where each slice's first block sits in the flat amax table
    row_stride: int  # table entries between two block rows (the scale tensor's columns)
    at: tuple[int, int]  # the slice's offset in its first block (rows, columns)


class SharedQuantizer:
    """The cut local tensors of some source ranks one member holds (``tensors``: rank -> its
    local tensors, derived ones included), quantized with shared block scales; ``table``: where
    each scale tensor's amaxes sit in the table all members reduce (it covers every tensor the
    ranks here cut, and the same on every member).  Slices of one geometry (an FSDP rank's ten
    thousand expert rows, say) are quantized together, a bounded chunk at a time."""

    def __init__(self, spec: ModelSpec, layout: QuantizedLayout, tensors: Mapping[int, Mapping[str, torch.Tensor]],
                 table: Mapping[str, TableEntry], chunk_elems: int = _CHUNK_ELEMS) -> None:
        self.table = dict(table)
        self.size = sum(math.prod(e.shape) for e in self.table.values())
        self.chunk_elems = chunk_elems
        fmt = quant_format(layout.quantization)
        self.block = fmt.block
        groups: dict[tuple, _Group] = {}
        for rank, own in tensors.items():
            for sb in layout.shared_blocks(spec, rank):
                for p, scale_lt in zip(sb.values.pieces, sb.scales):
                    self._add(groups, p, own, sb, scale_lt, fmt.scale_suffix)
        self.groups = list(groups.values())

    def _add(self, groups: dict[tuple, _Group], p: Piece, own: Mapping[str, torch.Tensor], sb: SharedBlocks,
             scale_lt: LocalTensor, suffix: str) -> None:
        """Piece ``p`` of ``sb``, one 2-D slice per index of its leading dims, into its group."""
        bm, bn = self.block
        ndim = len(p.start)
        entry = self.table[p.tensor + suffix]
        src = own[sb.source].view(sb.values.view_shape(ndim))[slices(p.local_start, p.size)]
        dst = own[sb.values.name].view(sb.values.view_shape(ndim))[slices(p.local_start, p.size)]
        scales = own[scale_lt.name].view(scale_lt.shape)
        rows, cols = p.size[-2:]
        first = (p.start[-2] // bm, p.start[-1] // bn)
        at = (p.start[-2] - first[0] * bm, p.start[-1] - first[1] * bn)
        group = groups.get((entry.offset, rows, cols, at))
        if group is None:
            group = groups[(entry.offset, rows, cols, at)] = _Group([], [], [], [], entry.shape[-1], at)
        strides = [math.prod(entry.shape[d + 1:]) for d in range(ndim)]
        for lead in itertools.product(*(range(n) for n in p.size[:-2])):
            start = tuple(a + i for a, i in zip(p.start, lead)) + first
            group.sources.append(src[lead])
            group.values.append(dst[lead])
            group.scales.append(scales[lead])
            group.bases.append(entry.offset + sum(i * st for i, st in zip(start, strides)))

    def partial_amax(self, device: torch.device) -> torch.Tensor:
        """The table with this member's parts' ``max|x|`` per block, zeros elsewhere (float32)."""
        table = torch.zeros(self.size, dtype=torch.float32, device=device)
        with torch.no_grad():
            for group, lo, hi in self._chunks():
                blocks, _ = self._work(group, lo, hi, device)
                amax = blocks.abs().amax(dim=(2, 4))
                table.scatter_reduce_(0, self._index(group, lo, hi, amax.shape[1:], device).flatten(),
                                      amax.flatten(), reduce="amax")
        return table

    def quantize(self, amax: torch.Tensor) -> None:
        """Each part with its blocks' scales, from the all-reduced ``amax`` table: values into
        the derived values tensors, every touched block's scale into the piece's scale tensor."""
        device = amax.device
        with torch.no_grad():
            fp8_max = torch.full((), FP8_MAX, dtype=torch.float32, device=device)
            for group, lo, hi in self._chunks():
                blocks, inner = self._work(group, lo, hi, device)
                index = self._index(group, lo, hi, blocks.shape[1:4:2], device)
                sf = amax[index].clamp(AMAX_MIN) / fp8_max  # as the reference: divided by a tensor
                blocks.mul_(torch.reciprocal(sf)[:, :, None, :, None])  # the reference's x * (1 / sf)
                torch._foreach_copy_(group.values[lo:hi], list(inner.unbind(0)))
                torch._foreach_copy_(group.scales[lo:hi], list(sf.unbind(0)))

    def _chunks(self) -> Iterator[tuple[_Group, int, int]]:
        """(group, first slice, end) in chunks whose padded float32 work fits `chunk_elems`."""
        bm, bn = self.block
        for group in self.groups:
            rows, cols = group.sources[0].shape
            padded = -(-(group.at[0] + rows) // bm) * bm * -(-(group.at[1] + cols) // bn) * bn
            step = max(1, self.chunk_elems // padded)
            for lo in range(0, len(group.sources), step):
                yield group, lo, min(lo + step, len(group.sources))

    def _work(self, group: _Group, lo: int, hi: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Slices ``lo:hi`` of ``group`` in float32, zero-padded to the blocks they touch, viewed
        as ``[n, block rows, bm, block cols, bn]``; and the slices' own view in it."""
        bm, bn = self.block
        (r0, c0), (rows, cols) = group.at, group.sources[0].shape
        nbr, nbc = -(-(r0 + rows) // bm), -(-(c0 + cols) // bn)
        padded = torch.zeros((hi - lo, nbr * bm, nbc * bn), dtype=torch.float32, device=device)
        inner = padded[:, r0:r0 + rows, c0:c0 + cols]
        torch._foreach_copy_(list(inner.unbind(0)), group.sources[lo:hi])
        return padded.view(hi - lo, nbr, bm, nbc, bn), inner

    @staticmethod
    def _index(group: _Group, lo: int, hi: int, grid: torch.Size | tuple[int, ...], device: torch.device
               ) -> torch.Tensor:
        """``[n, block rows, block cols]`` positions in the flat table of slices ``lo:hi``' blocks."""
        nbr, nbc = grid
        pattern = (torch.arange(nbr, device=device)[:, None] * group.row_stride
                   + torch.arange(nbc, device=device)[None, :])
        bases = torch.tensor(group.bases[lo:hi], dtype=torch.int64, device=device)
        return bases[:, None, None] + pattern[None]
