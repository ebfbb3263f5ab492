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
the one a quantization of the whole tensor gives.  Anything else is refused with the numbers —
vLLM refuses the same engine shards (``validate_fp8_block_shape``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from refit.errors import InvalidInput
from refit.layouts.base import Layout, LocalTensor, Piece
from refit.quantization import QuantFormat, is_quantized, quant_format, scale_shape
from refit.spec import ModelSpec, base_spec

_DIM_NAMES = ("rows", "columns")


@dataclass(frozen=True)
class QuantizedLayout:
    inner: Layout  # the framework's layout, resolved against the unquantized spec
    quantization: str  # a format of `refit.quantization`

    # The optimisation `all_holdings` takes from layouts whose ranks share tensors but a few
    # (vLLM's dp ranks) is the inner layout's business; this wrapper does not offer it.
    varying_key = None

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "quantization") or name.startswith("__"):  # not set yet (unpickling, copying)
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
        return QuantizedLayout(self.inner.resolve(base_of(spec)), self.quantization)

    def local_tensors(self, spec: ModelSpec, rank: int) -> list[LocalTensor]:
        fmt = quant_format(self.quantization)
        out: list[LocalTensor] = []
        for lt in self.inner.local_tensors(base_of(spec), rank):
            covered = [is_quantized(p.tensor) for p in lt.pieces]
            if not any(covered):
                out.append(lt)
                continue
            if not all(covered):
                raise InvalidInput(f"{self.describe()} rank {rank}: {lt.name} holds quantized and unquantized "
                                   f"tensors ({', '.join(sorted({p.tensor for p in lt.pieces}))})")
            out.extend(self._quantized(spec, lt, fmt, rank))
        return out

    def scale_locals(self, spec: ModelSpec, rank: int) -> dict[str, str]:
        """{local tensor holding quantized weights: the local tensor of its scales} of a rank."""
        suffix = quant_format(self.quantization).scale_suffix
        return {lt.name: lt.name + suffix for lt in self.inner.local_tensors(base_of(spec), rank)
                if lt.pieces and is_quantized(lt.pieces[0].tensor)}

    def _quantized(self, spec: ModelSpec, lt: LocalTensor, fmt: QuantFormat, rank: int) -> list[LocalTensor]:
        if len(lt.shape) < 2:
            raise InvalidInput(f"{self.describe()} rank {rank}: {lt.name} {list(lt.shape)} is not a matrix; "
                               f"{fmt.name} quantizes blocks of two dims")
        scales = []
        for p in lt.pieces:
            canon = spec[p.tensor].shape
            local = lt.view_shape(len(canon))
            for d, block in zip((-2, -1), fmt.block):
                _check_cut(self.describe(), rank, lt.name, p, canon, local, d, block, fmt)
            scales.append(Piece(p.tensor + fmt.scale_suffix, _blocks(p.start, fmt.block, math.floor),
                                _blocks(p.size, fmt.block, math.ceil), _blocks(p.local_start, fmt.block, math.floor)))
        return [LocalTensor(lt.name, lt.shape, fmt.value_dtype, lt.pieces),
                LocalTensor(lt.name + fmt.scale_suffix, scale_shape(lt.shape, fmt.block), fmt.scale_dtype,
                            tuple(scales))]


def _check_cut(layout: str, rank: int, local: str, p: Piece, canon: tuple[int, ...], local_shape: tuple[int, ...],
               d: int, block: int, fmt: QuantFormat) -> None:
    start, size, at = p.start[d], p.size[d], p.local_start[d]
    if canon[d] % block and not fmt.partial_blocks:
        what = _DIM_NAMES[d + 2]
        raise InvalidInput(f"{p.tensor} has {canon[d]} {what}: {fmt.name} needs a multiple of {block}")
    ends = start + size == canon[d] and at + size == local_shape[d]
    if start % block or at % block or (size % block and not ends):
        what = _DIM_NAMES[d + 2]
        raise InvalidInput(
            f"{layout} rank {rank}: {local} holds {what} [{start}, {start + size}) of {p.tensor} "
            f"({canon[d]} {what}) at {what} [{at}, {at + size}) of its {local_shape[d]}: that cuts {fmt.name}'s "
            f"blocks of {block} {what}.  Each block must lie whole on one rank, on block boundaries of its "
            f"local tensor: an engine's shards as vLLM requires (validate_fp8_block_shape), and a trainer's "
            f"because each block is quantized by one rank; choose degrees that keep them whole")


def _blocks(index: tuple[int, ...], block: tuple[int, int], rounding: Any) -> tuple[int, ...]:
    """``index`` with its last two entries in block units."""
    return tuple(index[:-2]) + (rounding(index[-2] / block[0]), rounding(index[-1] / block[1]))


@functools.lru_cache(maxsize=16)
def base_of(spec: ModelSpec) -> ModelSpec:
    """`refit.spec.base_spec`, cached: every rank's tensors are derived from it."""
    return base_spec(spec)
