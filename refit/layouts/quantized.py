"""Any layout, over a quantized model: where the float8 weights and their block scales sit.

A quantized spec (`refit.spec.quantize_spec`) is the unquantized one with each covered weight in
float8 and a scale tensor beside it.  A framework splits the quantized weight exactly as it splits
the unquantized one, so `QuantizedLayout` asks the framework's own layout for its local tensors of
the unquantized spec and derives the rest:

* a local tensor holding covered weights holds them in the format's value dtype, same shape;
* beside it sits ``<local name><scale suffix>`` (vLLM's ``qkv_proj.weight_scale_inv``,
  ``w13_weight_scale_inv``), holding the scales of the same pieces at their offsets divided by
  the block: the block grid of the local tensor's last two dims.

That is right only where every piece is cut on block boundaries, in the canonical tensor and in
the local one (a piece may end off a boundary only where both end): then each block of a local
tensor is a whole block of the canonical tensor, one rank quantizes it alone, and its scale is
the one a quantization of the whole tensor gives.  An engine whose shards cut blocks is refused
with the numbers — vLLM refuses the same shards (``validate_fp8_block_shape``).

A trainer's shards may cut FP8 blocks (FSDP2 ``fsdp:dp8`` splits a 512-row ``k_proj`` into 64
rows): its layout is made with ``shares_blocks`` (`refit.layouts.resolve_layout` does, for a
source).  Such a local tensor stays unquantized in `local_tensors` (held as the trainer holds it,
cast to the dtype quantized from, with no pieces: nothing is sent from it as it is), and
`shared_blocks` describes what the executor derives from it each refit (`refit.executor.shared_blocks`):

* its values, float8, under ``refit.quantized.<local name>``: the local tensor's shape and pieces;
* per piece, the scales of the canonical blocks the piece touches, of which it *owns* — sends —
  the blocks whose first element it holds (each block has exactly one owner, or identical
  replicas of one);
* the scale of a block cut across ranks is shared: every rank holding part of it contributes
  its part's ``max|x|``, the executor takes the maximum over the ranks (one all-reduce of a
  table laid out by `scale_table`), and each rank quantizes its own elements with that
  block's scale.  Exact: the reference's amax is the maximum over the block, and once the
  scale is known each element is quantized on its own.

The wire carries nothing more than for an uncut trainer (values once, each scale once); the cost
is the all-reduce of the cut tensors' scale grids (4 bytes a block) on the control group.
MXFP8's 1x32 blocks lie along the input dim, which trainers split in multiples of 32 (FSDP2 splits
rows): a trainer that cuts them is refused.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

from refit.errors import InvalidInput
from refit.layouts.base import Layout, LocalTensor, Piece
from refit.quantization import QuantFormat, is_quantized, quant_format, scale_shape
from refit.spec import ModelSpec, base_spec

_DIM_NAMES = ("rows", "columns")
DERIVED_PREFIX = "refit.quantized."  # the executor's tensors derived from a trainer's cut local tensor


class SharedBlocks(NamedTuple):
    """A trainer's local tensor that cuts blocks, and what the executor derives from it."""

    source: str  # the local tensor, held unquantized (in the dtype quantized from)
    values: LocalTensor  # float8: the source's shape and pieces
    scales: tuple[LocalTensor, ...]  # per piece of the source: its block box, pieces where it owns blocks


class TableEntry(NamedTuple):
    offset: int  # first element in the flat amax table
    shape: tuple[int, ...]  # the canonical scale tensor's shape


@dataclass(frozen=True)
class QuantizedLayout:
    inner: Layout  # the framework's layout, resolved against the unquantized spec
    quantization: str  # a format of `refit.quantization`
    # a trainer's layout: local tensors that cut blocks share their scales (see the module);
    # an engine's (False): they are refused, as vLLM refuses them
    shares_blocks: bool = False

    # The optimisation `all_holdings` takes from layouts whose ranks share tensors but a few
    # (vLLM's dp ranks) is the inner layout's business; this wrapper does not offer it.
    varying_key = None

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "quantization", "shares_blocks") or name.startswith("__"):  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)  # framework, degrees, tp, ep, ... of the framework's layout

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def describe(self) -> str:
        return self.inner.describe()

    def details(self) -> dict[str, int]:
        return self.inner.details()

    def replica_key(self, rank: int) -> tuple[int, ...]:
        return self.inner.replica_key(rank)

    def resolve(self, spec: ModelSpec) -> "QuantizedLayout":
        return QuantizedLayout(self.inner.resolve(base_of(spec)), self.quantization, self.shares_blocks)

    def local_tensors(self, spec: ModelSpec, rank: int) -> list[LocalTensor]:
        return list(_rank_view(self, spec, rank).locals)

    def scale_locals(self, spec: ModelSpec, rank: int) -> dict[str, str]:
        """{local tensor holding quantized weights: the local tensor of its scales} of a rank (a
        trainer's local tensors that cut blocks have none: `shared_blocks` covers them)."""
        return dict(_rank_view(self, spec, rank).scale_locals)

    def shared_blocks(self, spec: ModelSpec, rank: int) -> list[SharedBlocks]:
        """A trainer rank's local tensors that cut blocks, each with the tensors the executor
        derives from it (see the module); empty for an engine, and where nothing is cut."""
        return list(_rank_view(self, spec, rank).shared)

    def shared_scales(self, spec: ModelSpec, rank: int) -> set[str]:
        """The canonical scale tensors whose blocks ``rank``'s cut local tensors touch."""
        return {p.tensor + quant_format(self.quantization).scale_suffix
                for sb in _rank_view(self, spec, rank).shared for p in sb.values.pieces}

    def derived_tensors(self, spec: ModelSpec, rank: int) -> list[LocalTensor]:
        """The tensors `shared_blocks` derives, as local tensors the plan sends from."""
        return [lt for sb in _rank_view(self, spec, rank).shared for lt in (sb.values, *sb.scales)]

    def _view(self, spec: ModelSpec, rank: int) -> "_RankView":
        fmt = quant_format(self.quantization)
        base = base_of(spec)
        out: list[LocalTensor] = []
        scale_locals: dict[str, str] = {}
        shared: list[SharedBlocks] = []
        # whether a local tensor cuts blocks depends on its pieces' last two dims alone: a MoE
        # rank's 10^4 expert tensors share a handful of those (`_cut`, `_shared`)
        memo: dict[Any, Any] = {}
        for lt in self.inner.local_tensors(base, rank):
            covered = [is_quantized(p.tensor) for p in lt.pieces]
            if not any(covered):
                out.append(lt)
                continue
            if not all(covered):
                raise InvalidInput(f"{self.describe()} rank {rank}: {lt.name} holds quantized and unquantized "
                                   f"tensors ({', '.join(sorted({p.tensor for p in lt.pieces}))})")
            made = self._quantized(spec, lt, fmt, rank, memo)
            out.extend(made)
            if len(made) == 2:
                scale_locals[lt.name] = made[1].name
            else:  # a trainer's, cutting blocks: held unquantized, sent from what the executor derives
                shared.append(_shared(lt, fmt, memo))
        return _RankView(tuple(out), scale_locals, tuple(shared))

    def _cut(self, spec: ModelSpec, lt: LocalTensor, fmt: QuantFormat, rank: int, memo: dict[Any, Any]) -> bool:
        """Whether ``lt`` (of quantized weights) cuts blocks; refused where that is not allowed."""
        key = (lt.shape[-2:], tuple((p.tensor, p.start[-2:], p.size[-2:], p.local_start[-2:]) for p in lt.pieces))
        cuts = memo.get(key)
        if cuts is None:
            cuts = memo[key] = [(p, d, block) for p in lt.pieces for d, block in zip((-2, -1), fmt.block)
                                if _cuts(p, spec[p.tensor].shape, lt.view_shape(len(p.start)), d, block)]
        if not cuts:
            return False
        if self.shares_blocks and fmt.block[0] > 1:  # a trainer's FP8 blocks: shared scales
            return True
        p, d, block = cuts[0]
        problem = _cut_message(self.describe(), rank, lt.name, p, spec[p.tensor].shape,
                               lt.view_shape(len(p.start)), d, block, fmt)
        if self.shares_blocks:  # MXFP8: blocks along the input dim only
            raise InvalidInput(problem + f".  A trainer's shards may cut fp8's 128x128 blocks, not "
                               f"{fmt.name}'s 1x{fmt.block[1]} ones (they lie along the input dim, which trainers "
                               f"split in multiples of {fmt.block[1]}): choose degrees that keep them whole")
        raise InvalidInput(problem + ".  Each block must lie whole on one rank, on block boundaries of its local "
                           "tensor, as vLLM requires of an engine's shards (validate_fp8_block_shape); choose "
                           "degrees that keep them whole")

    def _quantized(self, spec: ModelSpec, lt: LocalTensor, fmt: QuantFormat, rank: int,
                   memo: dict[Any, Any]) -> list[LocalTensor]:
        if len(lt.shape) < 2:
            raise InvalidInput(f"{self.describe()} rank {rank}: {lt.name} {list(lt.shape)} is not a matrix; "
                               f"{fmt.name} quantizes blocks of two dims")
        for p in lt.pieces:
            canon = spec[p.tensor].shape
            for d, block in zip((-2, -1), fmt.block):
                if canon[d] % block and not fmt.partial_blocks:
                    raise InvalidInput(f"{p.tensor} has {canon[d]} {_DIM_NAMES[d + 2]}: {fmt.name} needs a "
                                       f"multiple of {block}")
        if self._cut(spec, lt, fmt, rank, memo):  # (the spec's dtype: the one its quantized weights come from)
            return [LocalTensor(lt.name, lt.shape, spec.config.dtype, ())]
        scales = []
        for p in lt.pieces:
            scales.append(Piece(p.tensor + fmt.scale_suffix, _blocks(p.start, fmt.block, math.floor),
                                _blocks(p.size, fmt.block, math.ceil), _blocks(p.local_start, fmt.block, math.floor)))
        return [LocalTensor(lt.name, lt.shape, fmt.value_dtype, lt.pieces),
                LocalTensor(lt.name + fmt.scale_suffix, scale_shape(lt.shape, fmt.block), fmt.scale_dtype,
                            tuple(scales))]


class _RankView(NamedTuple):
    """One rank of a `QuantizedLayout`: its local tensors, its scale locals, its shared blocks."""

    locals: tuple[LocalTensor, ...]
    scale_locals: dict[str, str]
    shared: tuple[SharedBlocks, ...]


@functools.lru_cache(maxsize=4)
def _rank_view(layout: QuantizedLayout, spec: ModelSpec, rank: int) -> _RankView:
    """`QuantizedLayout._view`, cached: planning asks for a rank's local and derived tensors back
    to back (`refit.layouts.base.sent_tensors`), and each walk of a MoE rank's tensors costs."""
    return layout._view(spec, rank)


def _cuts(p: Piece, canon: tuple[int, ...], local_shape: tuple[int, ...], d: int, block: int) -> bool:
    """Whether piece ``p`` cuts blocks of ``block`` on dim ``d``: it starts, or sits, off a
    boundary, or ends off one where the canonical and the local tensor do not both end."""
    start, size, at = p.start[d], p.size[d], p.local_start[d]
    return bool(start % block or at % block or (size % block and not (start + size == canon[d]
                                                                     and at + size == local_shape[d])))


def _cut_message(layout: str, rank: int, local: str, p: Piece, canon: tuple[int, ...],
                 local_shape: tuple[int, ...], d: int, block: int, fmt: QuantFormat) -> str:
    """What piece ``p`` of ``local`` does to the format's blocks on dim ``d`` (one that `_cuts`)."""
    start, size, at = p.start[d], p.size[d], p.local_start[d]
    what = _DIM_NAMES[d + 2]
    return (f"{layout} rank {rank}: {local} holds {what} [{start}, {start + size}) of {p.tensor} "
            f"({canon[d]} {what}) at {what} [{at}, {at + size}) of its {local_shape[d]}: that cuts "
            f"{fmt.name}'s blocks of {block} {what}")


def _shared(lt: LocalTensor, fmt: QuantFormat, memo: dict[Any, Any]) -> SharedBlocks:
    """What the executor derives from a trainer's local tensor ``lt`` that cuts blocks."""
    scales = []
    for i, p in enumerate(lt.pieces):
        key = (fmt.block, p.start[-2:], p.size[-2:])
        geometry = memo.get(key)
        if geometry is None:
            geometry = memo[key] = _block_geometry(p.start[-2:], p.size[-2:], fmt.block)
        box_lo, box_size, own_lo, own = geometry
        lead = len(p.start) - 2
        pieces = (Piece(p.tensor + fmt.scale_suffix, p.start[:lead] + own_lo, p.size[:lead] + own,
                        (0,) * lead + (own_lo[0] - box_lo[0], own_lo[1] - box_lo[1])),) if all(own) else ()
        scales.append(LocalTensor(f"{DERIVED_PREFIX}{lt.name}{fmt.scale_suffix}.{i}", p.size[:lead] + box_size,
                                  fmt.scale_dtype, pieces))
    values = LocalTensor(DERIVED_PREFIX + lt.name, lt.shape, fmt.value_dtype, lt.pieces)
    return SharedBlocks(lt.name, values, tuple(scales))


def _block_geometry(start: tuple[int, int], size: tuple[int, int], block: tuple[int, int]
                    ) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]:
    """Of a piece's rows and columns: the first block it touches and how many (the box of its
    scale tensor), and the first block it owns — holds the first element of — and how many."""
    lo = tuple(a // b for a, b in zip(start, block))
    hi = tuple(-(-(a + n) // b) for a, n, b in zip(start, size, block))
    own_lo = tuple(-(-a // b) for a, b in zip(start, block))
    return (lo, tuple(h - l for l, h in zip(lo, hi)), own_lo,  # type: ignore[return-value]
            tuple(max(0, h - o) for o, h in zip(own_lo, hi)))


def scale_table(spec: ModelSpec, scales: Iterable[str]) -> dict[str, TableEntry]:
    """Where each of the canonical scale tensors ``scales`` sits in the flat float32 table of
    block amaxes that the ranks all-reduce: their whole grids, in the spec's order (the same on
    every member that names the same tensors)."""
    wanted = set(scales)
    out, offset = {}, 0
    for t in spec.tensors:
        if t.name in wanted:
            out[t.name] = TableEntry(offset, t.shape)
            offset += math.prod(t.shape)
    return out


def shared_scale_table(spec: ModelSpec, layout: Any) -> dict[str, TableEntry]:
    """`scale_table` of every scale tensor whose blocks some rank of ``layout`` shares; empty
    when no local tensor cuts a block.  Walks every rank (planning does anyway): the executor's
    members instead agree on the tensors their own ranks cut (`refit.executor.member`)."""
    if not isinstance(layout, QuantizedLayout) or not layout.shares_blocks:
        return {}
    return scale_table(spec, {name for r in range(layout.world_size) for name in layout.shared_scales(spec, r)})


def _blocks(index: tuple[int, ...], block: tuple[int, int], rounding: Any) -> tuple[int, ...]:
    """``index`` with its last two entries in block units."""
    return tuple(index[:-2]) + (rounding(index[-2] / block[0]), rounding(index[-1] / block[1]))


@functools.lru_cache(maxsize=16)
def base_of(spec: ModelSpec) -> ModelSpec:
    """`refit.spec.base_spec`, cached: every rank's tensors are derived from it."""
    return base_spec(spec)
