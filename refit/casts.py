"""Dtype casts on the way: a trainer that holds a model in one floating dtype refits an engine
that holds it in another (verl's FSDP2 keeps float32 master parameters; engines serve bfloat16).

Pure data, like planning.  `casts_between` compares the two sides' specs tensor by tensor: equal
names and shapes are required (anything else is another model, refused with the first tensor that
differs), and each tensor whose dtype differs becomes a cast ``name -> source dtype``.

Where the cast happens, and why there.  The plan is made on the *destination's* spec: the wire
carries every tensor in the dtype the engine holds it in, and the engine's side of a refit is
untouched (it still writes its own buffers in place, at their addresses).  The trainer casts, from
its tensors into wire buffers of the engine's dtype, before the start barrier
(`refit.control.dataplane_executor`).  For the common case, narrowing (float32 -> bfloat16), that
is also the cheapest place: half the bytes cross the wire, and the extra memory (the wire buffers,
the shard in the narrow dtype) sits on the trainer, not beside the engine's KV cache.  Widening
(bfloat16 -> float32) moves twice the bytes of those tensors instead of staging on the engine; the
tensors engines keep wider than trainers (routers, biases) are small.

Rounding.  The cast is torch's ``Tensor.copy_`` between dtypes: round to nearest, ties to even,
overflow to infinity — the conversion vLLM's weight loaders apply when they copy a checkpoint's
tensor into a parameter of another dtype (``param.data.copy_(loaded_weight)``), so the engine holds
exactly what loading the trainer's weights would give it.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from refit.errors import InvalidInput
from refit.quantization import is_quantized
from refit.spec import ModelSpec, TensorSpec, base_spec, quantize_spec

# The dtypes a cast may join: floating types that round-trip through torch's copy_.  Casts into
# or out of float8 are quantization (scales, blocks), not a dtype change: refused here.
CASTABLE = frozenset({"bfloat16", "float16", "float32"})

Casts = Mapping[str, str]  # canonical tensor name -> the source's dtype (the plan's tensors hold the wire dtype)


def casts_between(src: ModelSpec, dst: ModelSpec) -> dict[str, str]:
    """The casts a plan from ``src`` to ``dst`` needs (empty for the same model in the same
    dtypes).  Raises `InvalidInput` for different tensors, or a dtype pair refit cannot cast.
    A quantized ``dst`` (an FP8 engine) is compared in the dtype it quantizes from: the trainer
    casts to that, then quantizes (`run_spec`)."""
    if src.config.quantization:
        raise InvalidInput(f"the trainer's model is quantized ({src.config.quantization}): refit moves trainers' "
                           f"unquantized weights")
    dst = base_spec(dst)
    mine, theirs = {t.name: t for t in src.tensors}, {t.name: t for t in dst.tensors}
    if mine.keys() != theirs.keys():
        only_src, only_dst = sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys())
        first = f"{only_src[0]!r} only in the trainer's" if only_src else f"{only_dst[0]!r} only in the engine's"
        raise InvalidInput(f"the trainer's and the engine's models have different tensors: {first} "
                           f"({len(only_src)} only in the trainer's, {len(only_dst)} only in the engine's)")
    out: dict[str, str] = {}
    for name, s in mine.items():
        d = theirs[name]
        if s.shape != d.shape or s.layers != d.layers:
            raise InvalidInput(f"the trainer's and the engine's models differ: {name!r} is {list(s.shape)} in the "
                               f"trainer's, {list(d.shape)} in the engine's")
        if s.dtype != d.dtype:
            _check_castable(s, d)
            out[name] = s.dtype
    return out


def _check_castable(s: TensorSpec, d: TensorSpec) -> None:
    if s.dtype not in CASTABLE or d.dtype not in CASTABLE:
        raise InvalidInput(f"{s.name!r} is {s.dtype} in the trainer's model and {d.dtype} in the engine's: refit "
                           f"casts between {', '.join(sorted(CASTABLE))} only (a float8 side is quantization)")


def run_spec(held: ModelSpec, casts: Casts, wire_dtypes: Mapping[str, str], digest: str, source: bool,
             quantization: tuple[str, str] | tuple[()] = ()) -> ModelSpec:
    """The spec one side runs a plan with, checked to be the plan's model (``digest``): an engine
    runs with the spec it holds; a trainer with its spec, each cast tensor in the wire's dtype —
    and, when the plan quantizes (``(format, dtype quantized from)``), cast to that dtype and
    quantized (`refit.spec.quantize_spec`)."""
    spec = held
    if source and quantization:
        fmt, base_dtype = quantization
        wire = {n: base_dtype if is_quantized(n) else wire_dtypes[n] for n in casts}
        spec = run_spec(held, casts, wire, "", True)
        spec = quantize_spec(ModelSpec(spec.name, dataclasses.replace(spec.config, dtype=base_dtype), spec.tensors),
                             fmt)
    elif source and casts:
        for name, dtype in casts.items():
            if name not in held or held[name].dtype != dtype:
                raise InvalidInput(f"the plan casts {name!r} from {dtype}; this trainer holds it in "
                                   f"{held[name].dtype if name in held else '(no such tensor)'}")
        spec = ModelSpec(held.name, held.config, tuple(
            TensorSpec(t.name, t.shape, wire_dtypes[t.name] if t.name in casts else t.dtype, t.layers)
            for t in held.tensors))
    if digest and spec.digest() != digest:
        raise InvalidInput(f"plan is for model {digest}, this worker holds {held.digest()}"
                           f"{' (cast on the way: ' + str(spec.digest()) + ')' if spec is not held else ''}")
    return spec


def describe(casts: Casts, wire_dtypes: Mapping[str, str]) -> dict[str, int]:
    """``{"float32->bfloat16": n, ...}``: how many tensors each cast covers (plan summaries, logs)."""
    out: dict[str, int] = {}
    for name, src_dtype in casts.items():
        key = f"{src_dtype}->{wire_dtypes[name]}"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))
