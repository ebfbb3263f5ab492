"""A trainer agent's tensors as the wire carries them, per plan: cast and quantized.

A plan may send a trainer's weights in another dtype than it holds them (float32 masters to a
bfloat16 engine: `refit.casts`) or quantized (an FP8 engine: `refit.quantization`).  Each refit,
before the start barrier, `TrainerWire.cast` copies the weights the plan casts into buffers of the
wire's dtype and quantizes the ones it quantizes into buffers of their values and scales; the
member sends from those.  The buffers are kept for the plan's life: the member built on them stays
valid, and the quantizer's launch plan, cached per set of tensors, too.

Quantizing on landing (`refit.executor.fused_quantize`): a colocated engine's driver may read the
weights as quantized from (`unquantized`) and quantize them straight into the engine.  Those
(`landed`, as the member's last build said: `Member.fused_sources`) are not quantized here, and
their buffers hold nothing — one element under the buffer's shape — so that a colocated FP8
trainer keeps no float8 copy of them (half of a bfloat16 model's bytes).  A verified refit's
checksums quantize them once more, into buffers of their own (`as_sent`).
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from refit.executor.quantize_grouped import quantize_many
from refit.quantization import quant_format

Tensors = Mapping[str, torch.Tensor]
# ((format, dtype quantized from), {weight local: (its scale local, its shape)})
Quantize = tuple[tuple[str, str], dict[str, tuple[str, tuple[int, ...]]]]


class TrainerWire:
    """Per plan hash: what a trainer casts and quantizes, its wire buffers, its weights as
    quantized from, and the ones drivers quantize on landing."""

    def __init__(self) -> None:
        self._casts: dict[str, dict[str, str]] = {}  # {local tensor: wire dtype}
        self._quantize: dict[str, Quantize] = {}
        self._buffers: dict[str, dict[str, torch.Tensor]] = {}
        self.unquantized: dict[str, dict[str, torch.Tensor]] = {}  # the weights as quantized from, by local name
        self.landed: dict[str, set[str]] = {}  # weights the drivers quantize on landing (`Member.fused_sources`)
        self._left_out: dict[str, bool] = {}  # whether the plan's last `cast` left landed weights out

    def add(self, plan_hash: str, casts: dict[str, str], quantize: Quantize | None) -> None:
        self._casts[plan_hash] = casts
        if quantize is not None:
            self._quantize[plan_hash] = quantize

    def changes(self, plan_hash: str) -> bool:
        """Whether the plan sends this trainer's tensors otherwise than it holds them."""
        return plan_hash in self._casts or plan_hash in self._quantize

    def quantizes(self, plan_hash: str) -> bool:
        return plan_hash in self._quantize

    def cast(self, plan_hash: str, tensors: Tensors, landed: set[str] = frozenset(),  # type: ignore[assignment]
             buffers: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The trainer's tensors as the wire carries them: each one the plan casts copied into a
        buffer of the engines' dtype (a weight the plan quantizes: of the dtype it is quantized
        from), then each one it quantizes in buffers of its values and scales (`_quantize_into`);
        the rest as they are.  ``landed``: weights the drivers quantize on landing: their buffers
        hold nothing (`_buffer`).  ``buffers``: where to cast and quantize (default: the plan's own).
        Rounding, and why here: `refit.casts`.  One ``_foreach_copy_`` for all: a loop of ``copy_``
        over a MoE shard's thousands of expert tensors ran at a third of the GPU's bandwidth
        (bench/probes/cast_copy.py: 32 ms against 12)."""
        if buffers is None:
            buffers = self._buffers.setdefault(plan_hash, {})
            self._left_out[plan_hash] = bool(landed)
        out = dict(tensors)
        sources, targets = [], []
        for name, dtype in self._casts.get(plan_hash, {}).items():
            t = tensors[name]
            sources.append(t)
            targets.append(_buffer(buffers, f"{name}@{dtype}", t.shape, dtype, t.device))
            out[name] = targets[-1]
        if targets:
            with torch.no_grad():
                torch._foreach_copy_(targets, sources)
        if plan_hash in self._quantize:
            self._quantize_into(plan_hash, out, buffers, skip=landed)
        return out

    def as_sent(self, plan_hash: str, moved: Tensors) -> Tensors:
        """``moved`` (what the last refit sent from) with the weights quantized on landing
        quantized again, into buffers of their own: what the engines received, for checksums."""
        landed = self.landed.get(plan_hash)
        if not landed or not self._left_out.get(plan_hash):
            return moved
        out = dict(moved)
        self._quantize_into(plan_hash, out, {}, only=landed)
        return out

    def _quantize_into(self, plan_hash: str, out: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                       skip: set[str] = frozenset(), only: set[str] | None = None) -> None:  # type: ignore[assignment]
        """Quantize each weight the plan quantizes (in ``out``: already cast to the dtype it is
        quantized from) into wire buffers of its values and its scales, which replace it in
        ``out`` (`refit.executor.quantize`: bit for bit what vLLM's quantization of the same
        tensor gives) — but those of ``skip``, or only those of ``only``.  What they were
        quantized from is kept for the drivers that quantize on landing (`unquantized`)."""
        (fmt_name, _), scales = self._quantize[plan_hash]
        fmt = quant_format(fmt_name)
        held = self.unquantized.setdefault(plan_hash, {})
        xs, outs, scale_outs = [], [], []
        for name, (scale_name, scale_shape) in scales.items():
            t = held[name] if only is not None else out[name]
            held[name] = t
            empty = name in skip  # nothing reads its wire buffers
            value = _buffer(buffers, name, t.shape, fmt.value_dtype, t.device, empty)
            scale = _buffer(buffers, scale_name, scale_shape, fmt.scale_dtype, t.device, empty)
            out[name], out[scale_name] = value, scale
            if name not in skip and (only is None or name in only):
                xs.append(t)
                outs.append(value)
                scale_outs.append(scale)
        with torch.no_grad():  # few launches for thousands of expert tensors (cached while the tensors stay)
            quantize_many(fmt_name, xs, outs, scale_outs)

    def clear(self) -> None:
        self._buffers.clear()
        self.unquantized.clear()
        self.landed.clear()


def _buffer(buffers: dict[str, torch.Tensor], key: str, shape: tuple[int, ...] | torch.Size, dtype: str,
            device: torch.device, placeholder: bool = False) -> torch.Tensor:
    """The wire buffer ``key`` of a plan, made anew only when the trainer's tensor changed shape or
    device, or it is to become or stop being a ``placeholder`` (kept for the plan's life: the
    member built on it stays valid, and the quantizer's launch plan, cached per set of tensors, too).
    A placeholder has the buffer's shape over one element (strides 0): the buffer of a weight the
    drivers quantize on landing, which nothing reads — a colocated FP8 trainer keeps no float8
    copy of those weights (half of a bfloat16 model's bytes).  Its members are built once more
    when it appears (its address changed)."""
    placeholder = placeholder and math.prod(shape) > 1  # one element: the buffer itself
    buf = buffers.get(key)
    if buf is None or buf.shape != shape or buf.device != device or _is_placeholder(buf) != placeholder:
        kind = getattr(torch, dtype)
        buf = buffers[key] = (torch.empty(1, dtype=kind, device=device).expand(shape) if placeholder
                              else torch.empty(shape, dtype=kind, device=device))
    return buf


def _is_placeholder(t: torch.Tensor) -> bool:
    return t.numel() > 1 and t.untyped_storage().nbytes() < t.numel() * t.element_size()
