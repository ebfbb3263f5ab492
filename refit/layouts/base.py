"""What a layout is: for every rank, its local tensors and the canonical boxes each one holds.

Contract of a layout (one class per framework, each in its own module):

1. ``parse``: a layout is built from degrees parsed out of a string (``megatron:tp4ep8``); the
   class declares its ``framework`` name and the ``degrees`` it takes, and is listed in the
   registry of `refit.layouts` (``LAYOUTS``), which does the parsing.
2. ``resolve(spec)`` fills the degrees the framework would derive (dp, etp, edp, vocab padding,
   pipeline split) and checks that the model can be split that way, raising `RefitError` with the
   numbers when it cannot.  Only resolved layouts are asked for tensors.
3. ``local_tensors(spec, rank)`` lists the rank's tensors under the framework's own local names,
   in the framework's own order, each with its *pieces*.

A `Piece` says: the canonical box ``start/size`` of tensor ``tensor`` sits at ``local_start`` of
the local tensor.  Local coordinates are taken on the local tensor viewed with as many
dimensions as the canonical one, by prepending dimensions of size 1 (a Megatron
``linear_fc1.weight3`` of shape ``[2I, H]`` is viewed as ``[1, 1, 2I, H]`` against the canonical
``[L, E, I, H]``).  Elements of a local tensor covered by no piece are padding (vocab rows), and
hold zeros.
"""

from __future__ import annotations

import functools
from collections import defaultdict
import math
from typing import ClassVar, Hashable, Iterable, NamedTuple, Protocol

from refit.boxes import Box, Index, join_runs, merge_boxes
from refit.dtypes import DTYPE_BYTES
from refit.errors import InvalidInput
from refit.spec import ModelSpec


class Piece(NamedTuple):
    tensor: str
    start: Index
    size: Index
    local_start: Index


class LocalTensor(NamedTuple):
    name: str
    shape: Index
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]

    def view_shape(self, ndim: int) -> Index:
        """The local shape with leading 1s so it has ``ndim`` dimensions (see module docstring)."""
        return (1,) * (ndim - len(self.shape)) + self.shape


class Layout(Protocol):
    framework: ClassVar[str]  # the prefix of its layout strings: ``megatron`` in ``megatron:tp4ep8``
    degrees: ClassVar[tuple[str, ...]]  # the degrees a layout string may give (constructor keywords)
    examples: ClassVar[tuple[str, ...]]  # layout strings shown in LAYOUT_HELP

    @property
    def world_size(self) -> int: ...

    def describe(self) -> str:
        """The resolved layout as a string that parses back to the same layout."""
        ...

    def details(self) -> dict[str, int]:
        """Every degree, resolved (printed for the user)."""
        ...

    def resolve(self, spec: ModelSpec) -> "Layout": ...

    def local_tensors(self, spec: ModelSpec, rank: int) -> list[LocalTensor]: ...

    def replica_key(self, rank: int) -> tuple[int, ...]:
        """Ranks with equal keys hold the same tensors (data-parallel replicas)."""
        ...


def divides(what: str, n: int, by_what: str, d: int) -> None:
    """Refuse with the numbers when ``d`` does not divide ``n``."""
    if d <= 0 or n % d:
        raise InvalidInput(f"{what} ({n}) is not divisible by {by_what} ({d})")


def pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def vocab_pieces(tensor: str, vocab: int, hidden: int, padded: int, tp: int, tp_rank: int) -> tuple[Index, tuple[Piece, ...]]:
    """Shape and pieces of one TP shard of a vocab-padded embedding or output layer."""
    per_rank = padded // tp
    lo = tp_rank * per_rank
    real = max(0, min(vocab, lo + per_rank) - lo)
    pieces = (Piece(tensor, (lo, 0), (real, hidden), (0, 0)),) if real else ()
    return (per_rank, hidden), pieces


def holdings(spec: ModelSpec, layout: Layout, rank: int) -> dict[str, list[Box]]:
    """Canonical tensor -> the boxes a rank holds, coalesced."""
    return holdings_of(sent_tensors(spec, layout, rank))


def sent_tensors(spec: ModelSpec, layout: Layout, rank: int) -> list[LocalTensor]:
    """A rank's local tensors, and those the executor derives from them before sending (a
    trainer's local tensors that cut FP8 blocks: `refit.layouts.quantized`): what a plan's boxes
    are read from or written into."""
    tensors = layout.local_tensors(spec, rank)
    derived = getattr(layout, "derived_tensors", None)
    return tensors if derived is None else [*tensors, *derived(spec, rank)]


def holdings_of(tensors: Iterable[LocalTensor]) -> dict[str, list[Box]]:
    """Canonical tensor -> the boxes some local tensors hold, coalesced, in order of first appearance."""
    # Hot loop for MoE models (a rank holds E/EP experts x layers pieces): group pieces that differ
    # only on dim 0 (their layer, mostly) right away, and join their runs before the general merge.
    along0: dict[tuple[str, Index, Index], list[tuple[int, int]]] = defaultdict(list)
    for lt in tensors:
        for tensor, start, size, _ in lt.pieces:
            along0[(tensor, start[1:], size[1:])].append((start[0], size[0]))
    boxes: dict[str, list[Box]] = defaultdict(list)
    for (tensor, rest_start, rest_size), intervals in along0.items():
        boxes[tensor].extend(((lo,) + rest_start, (n,) + rest_size) for lo, n in join_runs(intervals))
    return {name: merge_boxes(bs, joined_along0=True) for name, bs in boxes.items()}


@functools.lru_cache(maxsize=8)
def all_holdings(spec: ModelSpec, layout: Layout) -> list[dict[str, list[Box]]]:
    """Holdings of every rank (cached: planners and summaries ask for the same ones; do not mutate).

    A layout may also say, with ``varying_key(rank) -> key | None`` and ``varying_tensors(spec,
    rank)``, that ranks with equal keys hold the same local tensors but for the varying ones,
    which alone hold their canonical tensors and sit at the same places in every such rank's list
    (a vLLM MoE engine's dp ranks differ only in their routed experts).  Then only those are
    coalesced again for each further rank; the rest is taken from the first rank with that key."""
    by_key: dict[tuple[int, ...], dict[str, list[Box]]] = {}
    # varying key -> [its first rank, that rank's holdings, the names its varying tensors hold]
    shared: dict[Hashable, list] = {}
    varying_key = getattr(layout, "varying_key", None)
    out = []
    for r in range(layout.world_size):
        key = layout.replica_key(r)
        if key not in by_key:
            vkey = varying_key(r) if varying_key is not None else None
            first = shared.get(vkey) if vkey is not None else None
            held = None
            if first is not None:
                if first[2] is None:
                    first[2] = list(_names(layout.varying_tensors(spec, first[0])))
                own = holdings_of(layout.varying_tensors(spec, r))
                if list(own) == first[2]:
                    held = {name: own.get(name, boxes) for name, boxes in first[1].items()}
            if held is None:
                held = holdings(spec, layout, r)
                if vkey is not None and first is None:
                    shared[vkey] = [r, held, None]
            by_key[key] = held
        out.append(by_key[key])
    return out


def _names(tensors: Iterable[LocalTensor]) -> dict[str, None]:
    """The canonical tensors some local tensors hold, in order of first appearance."""
    return dict.fromkeys(p.tensor for lt in tensors for p in lt.pieces)
