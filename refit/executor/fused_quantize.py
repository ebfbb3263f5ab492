"""Quantizing on landing: a same-device move of float8 values becomes one quantization of the
trainer's unquantized block straight into the engine's values and scales.

A refit into an FP8 engine normally costs two passes over the weights: each trainer rank
quantizes its shard into wire shards (reads 2 bytes an element, writes 1 and the scales), then
the refit copies those into the engine's tensors (reads 1, writes 1).  Where a trainer and an
engine share a device (colocated), the device's driver can read the trainer's unquantized
tensors itself and quantize each block into the engine's own memory: 3 bytes an element instead
of 5, and no quantizing before the refit.  The bytes the engine ends up with are the same: the
quantizer (`refit.executor.quantize_grouped`) computes a block's scale from that block alone, so
quantizing a piece of a tensor gives the very bytes quantizing the whole tensor gives, provided
the piece starts on a block boundary of the canonical tensor and of the engine's local tensor,
and ends on one or at the tensor's far edge.

`fuse_program` (pure data) rewrites a compiled `Program`: per stage and per engine local tensor
of float8 values, when every move into it comes from a trainer whose unquantized tensors this
member holds (`UNQUANTIZED_PREFIX`) and lies on block boundaries, and the scale moves into its
scale tensor cover exactly the blocks those moves write, the value and scale moves become
`QuantizeMove` s.  Anything else stays a move of the wire's bytes.  It returns which trainer
local tensors it took over; of those, a trainer skips quantizing for the wire the ones nothing
else reads (`wire_reads`, `read_elsewhere`; `Member.fused_sources`): a trainer rank's tensor that
also feeds an engine on another GPU still goes on the wire quantized.  `QuantizeBatch` binds a stage's quantize moves to tensors: one
`quantize_many` call (a few launches) per refit.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from dataclasses import replace
from typing import Any, Collection, Mapping, Sequence

import torch

from refit.boxes import volume
from refit.executor.quantize_grouped import plan_fp8_many, quantize_many, run_fp8_many
from refit.executor.schedule import Move, Program, QuantizeMove, Stage, bucket_ends
from refit.executor.topology import Endpoint, Topology
from refit.layouts import Layout, LocalTensor, Piece
from refit.layouts.quantized import QuantizedLayout
from refit.plan import Plan
from refit.quantization import QuantFormat, quant_format
from refit.regions import Block, slices
from refit.spec import ModelSpec

UNQUANTIZED_PREFIX = "refit.unquantized."  # a trainer's local tensor as it holds it, for `QuantizeMove.src`

Fused = dict[Endpoint, set[str]]  # trainer endpoint -> its local tensors quantized on landing


def fuse_program(program: Program, spec: ModelSpec, dst: Layout,
                 sources: Mapping[Endpoint, Collection[str]]) -> tuple[Program, Fused]:
    """``program`` with its eligible same-device moves of float8 values quantized on landing
    (see the module); ``sources``: the trainer endpoints whose unquantized local tensors this
    member holds, by local tensor name.  Returns the program and the trainer local tensors fused."""
    if not isinstance(dst, QuantizedLayout) or not any(sources.values()):
        return program, {}
    fuser = _Fuser(spec, dst, quant_format(dst.quantization), sources)
    stages = tuple(fuser.stage(st) for st in program.stages)
    return replace(program, stages=stages), fuser.fused


class _Fuser:
    def __init__(self, spec: ModelSpec, dst: QuantizedLayout, fmt: QuantFormat,
                 sources: Mapping[Endpoint, Collection[str]]) -> None:
        self.spec, self.dst, self.fmt = spec, dst, fmt
        self.sources = {ep: set(names) for ep, names in sources.items()}
        self.fused: Fused = defaultdict(set)
        self._scales: dict[Endpoint, dict[str, str]] = {}  # an engine rank's values local -> its scales local
        self._scale_set: dict[Endpoint, set[str]] = {}
        self._locals: dict[Endpoint, dict[str, LocalTensor]] = {}

    def _scale_locals(self, ep: Endpoint) -> dict[str, str]:
        if ep not in self._scales:
            self._scales[ep] = self.dst.scale_locals(self.spec, ep[1])
            self._scale_set[ep] = set(self._scales[ep].values())
            self._locals[ep] = {lt.name: lt for lt in self.dst.local_tensors(self.spec, ep[1])}
        return self._scales[ep]

    def stage(self, st: Stage) -> Stage:
        values: dict[tuple[Endpoint, str], list[Move]] = defaultdict(list)
        scales: dict[tuple[Endpoint, str], list[Move]] = defaultdict(list)
        kept: list[Move] = []
        for m in st.moves:
            if m.dst_ep[0] is m.src_ep[0]:  # not a trainer-to-engine move
                kept.append(m)
                continue
            scale_of = self._scale_locals(m.dst_ep)
            if m.dst.local in scale_of:
                values[(m.dst_ep, m.dst.local)].append(m)
            elif m.dst.local in self._scale_set[m.dst_ep]:
                scales[(m.dst_ep, m.dst.local)].append(m)
            else:
                kept.append(m)
        quantizes: list[QuantizeMove] = []
        for (ep, name), ms in values.items():
            scale_name = self._scales[ep][name]
            made = [self._quantize_move(m, scale_name) for m in ms]
            if all(q is not None for q in made) and _tiles([q.scales for q in made], scales[(ep, scale_name)]):
                quantizes += made
                scales.pop((ep, scale_name))
                for m in ms:
                    self.fused[m.src_ep].add(m.src.local)
            else:
                kept += ms
        kept += [m for ms in scales.values() for m in ms]
        if not quantizes:
            return st
        order = {m: i for i, m in enumerate(st.moves)}
        return replace(st, moves=tuple(sorted(kept, key=order.__getitem__)), quantizes=tuple(quantizes))

    def _quantize_move(self, m: Move, scale_name: str) -> QuantizeMove | None:
        """``m`` (float8 values into the engine) as a quantization of the trainer's unquantized
        block, or None where the trainer's tensor is not held here or the block is off the grid."""
        if m.src.local not in self.sources.get(m.src_ep, ()):
            return None
        lt = self._locals[m.dst_ep][m.dst.local]
        piece = _piece_at(lt, m.dst.local_start)
        if piece is None:
            return None
        canon = self.spec[piece.tensor].shape
        start, size = m.dst.local_start, m.dst.size
        for d, block in zip((-2, -1), self.fmt.block):
            first = piece.start[d] + start[d] - piece.local_start[d]  # in the canonical tensor
            if start[d] % block or first % block or (size[d] % block and first + size[d] != canon[d]):
                return None
        b0, b1 = self.fmt.block
        scale_start = tuple(start[:-2]) + (start[-2] // b0, start[-1] // b1)
        scale_size = tuple(size[:-2]) + (math.ceil(size[-2] / b0), math.ceil(size[-1] / b1))
        src = Block(UNQUANTIZED_PREFIX + m.src.local, m.src.local_start, m.src.box_start, m.src.size)
        return QuantizeMove(m.src_ep, src, m.dst_ep, m.dst,
                            Block(scale_name, scale_start, (0,) * len(scale_start), scale_size), self.fmt.name)


def wire_reads(program: Program) -> dict[Endpoint, set[str]]:
    """The trainer local tensors each of ``program``'s copies and wires still reads (what a
    trainer must keep quantizing for the wire)."""
    reads: dict[Endpoint, set[str]] = defaultdict(set)
    for st in program.stages:
        for m in (*st.moves, *st.pulls):
            reads[m.src_ep].add(m.src.local)
        for step in st.steps:
            for w in step.sends:
                reads[w.ep].update(b.local for t in w.transfers for b in t.blocks)
    return reads


def read_elsewhere(plan: Plan, topo: Topology, ep: Endpoint) -> bool:
    """Whether a bucket from trainer ``ep`` goes to a device other than its own: with the ipc
    transport that device's driver reads ``ep``'s shard itself, beyond what this driver sees."""
    here = topo.device_of[ep]
    return any(b.sender == ep[1] and topo.device_of[bucket_ends(b)[1]] != here for b in plan.buckets)


def _piece_at(lt: LocalTensor, start: tuple[int, ...]) -> Piece | None:
    """The piece of ``lt`` holding local element ``start`` (canonical dims)."""
    for p in lt.pieces:
        if all(a <= s < a + n for s, a, n in zip(start, p.local_start, p.size)):
            return p
    return None


def _tiles(regions: Sequence[Block], moves: Sequence[Move]) -> bool:
    """Whether the scale ``regions`` quantizing writes are exactly what the scale ``moves`` write:
    each region inside one move's block, and as many elements in all (the moves' blocks are
    disjoint, and so are the regions)."""
    if sum(volume(r.size) for r in regions) != sum(volume(m.dst.size) for m in moves):
        return False
    boxes = {(m.dst.local_start, m.dst.size) for m in moves}
    for r in regions:
        if (r.local_start, r.size) in boxes:
            continue
        if not any(all(a <= s and s + n <= a + k for s, n, a, k in zip(r.local_start, r.size, b.local_start, b.size))
                   for b in (m.dst for m in moves)):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Bound to tensors


class QuantizeBatch:
    """A stage's quantize moves over real tensors: one `quantize_many` per refit.  Speaks the
    part of `refit.executor.copies.CopyBatch` that `refit.executor.device` issues (`Batch`)."""

    def __init__(self, moves: Sequence[QuantizeMove], tensors: Mapping[Endpoint, Mapping[str, torch.Tensor]]) -> None:
        self.fmt = moves[0].fmt
        self.xs: list[torch.Tensor] = []
        self.outs: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []
        for m in moves:
            xs = _matrices(tensors[m.src_ep][m.src.local], m.src)
            outs = _matrices(tensors[m.dst_ep][m.values.local], m.values)
            scales = _matrices(tensors[m.dst_ep][m.scales.local], m.scales)
            self.xs += xs
            self.outs += outs
            self.scales += scales
        self.nbytes = sum(x.numel() * x.element_size() for x in self.xs)
        self.copies = len(self.xs)
        self._plan: Any = None  # `plan_fp8_many`'s

    def run_memcpys(self, stream: int, device_index: int | None = None) -> None:
        """Nothing for the copy engines: quantizing is a kernel."""

    def run(self) -> None:
        with torch.no_grad():
            if self.fmt != "fp8":
                quantize_many(self.fmt, self.xs, self.outs, self.scales)
                return
            # its own launch plan, made at the first refit on the stream it runs on: the grouped
            # quantizer's cache holds a few sets of tensors, fewer than a phased plan's stages
            if self._plan is None:
                self._plan = plan_fp8_many(self.xs, self.outs, self.scales)
            run_fp8_many(self._plan, self.xs, self.outs, self.scales)

    def __repr__(self) -> str:
        return f"QuantizeBatch({self.fmt}: {self.copies} blocks, {self.nbytes} bytes read)"


def _matrices(t: torch.Tensor, b: Block) -> list[torch.Tensor]:
    """Block ``b`` of ``t`` (viewed with the block's dims) as 2-D views, one per leading index."""
    ndim = len(b.size)
    view = t.view((1,) * (ndim - t.dim()) + tuple(t.shape))[slices(b.local_start, b.size)]
    if ndim == 2:
        return [view]
    return [view[idx] for idx in itertools.product(*(range(n) for n in b.size[:-2]))]


def unquantized_views(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A trainer's unquantized local tensors under the names quantize moves read them by."""
    return {UNQUANTIZED_PREFIX + name: t for name, t in tensors.items()}


__all__ = ["UNQUANTIZED_PREFIX", "Fused", "QuantizeBatch", "fuse_program", "read_elsewhere", "unquantized_views",
           "wire_reads"]
