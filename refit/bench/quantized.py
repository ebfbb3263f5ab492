"""The bench's side of quantizing on the wire (``refit-bench --dst-dtype fp8``).

A trainer holds its shard unquantized; each refit it quantizes the weights the plan covers into
wire shards — float8 values and block scales, in the layout the plan moves — then the refit
moves those.  The bench does the same, and times the quantization inside each refit.

Values: the bench's canonical values are hashed bit patterns (`refit.executor.values`), which
as bfloat16 include NaNs and infinities that no trained weight holds.  Quantized weights get
finite values instead, a function of the same bits: sign and mantissa kept, the exponent folded
into 8 binades (magnitudes from 2^-7 to 2): blocks then hold outliers 2^8 above their smallest
values, and the checks quantize exactly those values again.
"""

from __future__ import annotations

import math

import torch

from refit.errors import InvalidInput
from refit.executor.quantize import quantize
from refit.executor.quantize_grouped import quantize_many
from refit.executor.shards import Shards, Verdict, verify
from refit.executor.values import fill_box, int_view
from refit.layouts import Piece, QuantizedLayout
from refit.quantization import QuantFormat, is_quantized, quant_format
from refit.regions import slices
from refit.spec import ModelSpec, base_spec


def finite_bf16(bits: torch.Tensor) -> None:
    """Make bfloat16 bit patterns (int16, in place) finite normal numbers: sign and mantissa
    kept, exponent set to one of 8 binades picked by three of the bits."""
    binade = (bits >> 7) & 0x7
    bits.copy_((bits & ~0x7F80) | ((0x78 + binade) << 7))


def fill_finite(shards: Shards, spec: ModelSpec, seed: int) -> None:
    """A trainer's unquantized shard: canonical values, made finite in the quantized weights."""
    from refit.executor.shards import fill_source

    if spec.config.dtype != "bfloat16":
        raise InvalidInput(f"--dst-dtype quantizes bfloat16 models; {spec.name} is {spec.config.dtype}")
    fill_source(shards, spec, seed)
    for lt in shards.locals:
        local = shards.tensors[lt.name]
        for p in lt.pieces:
            if is_quantized(p.tensor):
                finite_bf16(int_view(local.view(lt.view_shape(len(spec[p.tensor].shape)))[slices(p.local_start, p.size)]))


class SourceQuantizer:
    """One trainer rank's wire shard from its unquantized one, each refit: each quantized weight
    into its values and scales (but those quantized on landing: `skip`); every other tensor is
    copied as it is when the weights are filled (`copy_plain`).  The tensor lists are
    made once: a MoE shard has ten thousand tensors, and deriving them again each refit cost
    more than the quantizing (as `refit.control.dataplane_executor` derives them once a plan)."""

    def __init__(self, base: Shards, wire: Shards, layout: QuantizedLayout, spec: ModelSpec, rank: int) -> None:
        self.fmt = layout.quantization
        self.base, self.wire, self.scale_of = base, wire, layout.scale_locals(spec, rank)
        self.skip(set())
        # as bits: a CUDA copy of bfloat16 rewrites NaN patterns (the canonical values hold some)
        self.plain_src = [int_view(t) for name, t in base.tensors.items() if name not in self.scale_of]
        self.plain_dst = [int_view(wire.tensors[name]) for name in base.tensors if name not in self.scale_of]

    def skip(self, landed: set[str]) -> None:
        """Quantize every weight but those of ``landed``, which the refit quantizes on landing
        (`refit.executor.fused_quantize`)."""
        names = [n for n in self.base.tensors if n in self.scale_of and n not in landed]
        self.xs = [self.base.tensors[n] for n in names]
        self.outs = [self.wire.tensors[n] for n in names]
        self.scales = [self.wire.tensors[self.scale_of[n]] for n in names]

    def copy_plain(self) -> None:
        """The tensors the plan does not quantize, into the wire shard: once a fill (untimed), as
        a trainer sends those in place — the bench's wire shard is an arena of its own."""
        if self.plain_dst:
            torch._foreach_copy_(self.plain_dst, self.plain_src)

    def __call__(self) -> None:
        quantize_many(self.fmt, self.xs, self.outs, self.scales)


def verify_quantized(shards: Shards, spec: ModelSpec, seed: int) -> Verdict:
    """`refit.executor.shards.verify` for an engine holding ``spec`` quantized: every element of
    every quantized weight and of its scales equal to quantizing the canonical (finite) values of
    the same box; everything else as `verify` checks it."""
    fmt = quant_format(spec.config.quantization)
    base = base_spec(spec)
    weights = [lt for lt in shards.locals if lt.pieces and is_quantized(lt.pieces[0].tensor)]
    scale_of = {lt.name: lt.name + fmt.scale_suffix for lt in weights}
    quantized = set(scale_of) | set(scale_of.values())
    rest = Shards([lt for lt in shards.locals if lt.name not in quantized], shards.arena, shards.tensors)
    plain = verify(rest, spec, seed)
    checked, bad, first = plain.checked, plain.mismatches, plain.first
    by_name = {lt.name: lt for lt in shards.locals}
    for lt in weights:
        values = shards.tensors[lt.name]
        scale_lt = by_name[scale_of[lt.name]]
        scales = shards.tensors[scale_lt.name]
        for p, sp in zip(lt.pieces, scale_lt.pieces):
            n, desc = _check_piece(values.view(lt.view_shape(len(spec[p.tensor].shape))), p, sp,
                                   scales.view(scale_lt.view_shape(len(spec[sp.tensor].shape))),
                                   base[p.tensor].shape, seed, fmt)
            checked += math.prod(p.size) + math.prod(sp.size)
            bad += n
            if desc and first is None:
                first = f"{lt.name}: {desc}"
    return Verdict(checked, bad, plain.stray, first)


def _check_piece(values: torch.Tensor, p: Piece, sp: Piece, scales: torch.Tensor, shape: tuple[int, ...], seed: int,
                 fmt: QuantFormat) -> tuple[int, str | None]:
    """Mismatches of one weight piece ``p`` (in ``values``) and its scales' piece ``sp``."""
    want = torch.empty(p.size, dtype=torch.bfloat16, device=values.device)
    fill_box(want, p.tensor, shape, p.start, seed)
    finite_bf16(int_view(want))
    q, s = quantize(fmt.name, want)
    got_q, got_s = values[slices(p.local_start, p.size)], scales[slices(sp.local_start, sp.size)]
    bad_q = int((got_q.view(torch.uint8) != q.view(torch.uint8)).sum().item())
    bad_s = int((got_s.view(torch.uint8) != s.view(torch.uint8)).sum().item())
    if not bad_q + bad_s:
        return 0, None
    return bad_q + bad_s, f"{p.tensor} box at {p.start}: {bad_q} values and {bad_s} scales differ"

