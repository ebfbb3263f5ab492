"""Smaller variants of a model spec for ``refit-bench``: its first layers at full width
(``--layers``), or the reduced width a CPU run uses.

Both keep the architecture and the counts of heads, kv heads and experts, so the layouts split the
smaller model as they split the real one.  Apart from `refit.bench.cli` because they are spec
arithmetic, used outside the command line as well (bench/cast_refit.py and
bench/predict_vs_measured.py cut models with `first_layers`).
"""

from __future__ import annotations

import dataclasses

from refit.errors import InvalidInput, RefitError
from refit.layouts import resolve_layout
from refit.layouts.quantized import shared_scale_table
from refit.planners import make_plan
from refit.sides import Side
from refit.spec import ModelSpec, build_spec, quantize_spec


def first_layers(spec: ModelSpec, layers: int) -> ModelSpec:
    """``spec`` cut to its first ``layers`` decoder layers, every width kept: a big model's real
    shapes on a machine that cannot hold all of it twice (qwen3-235b-moe's 20 first layers fit
    beside their destination in two H200s)."""
    c = spec.config
    if not 1 <= layers <= c.num_layers:
        raise InvalidInput(f"--layers {layers}: must be 1 to {c.num_layers} ({spec.name}'s decoder layers)")
    # MTP layers follow the last decoder layer (and are never moved): a cut model has none
    cfg = dataclasses.replace(c, num_layers=layers, moe_layers=tuple(l for l in c.moe_layers if l < layers),
                              num_mtp_layers=c.num_mtp_layers if layers == c.num_layers else 0)
    return build_spec(f"{spec.name}[:{layers}]" if layers < c.num_layers else spec.name, cfg)


def reduce_spec(spec: ModelSpec, src: str, dst: str, quantization: str | None = None
                ) -> tuple[ModelSpec, dict[str, list[int]]]:
    """The smallest variant of ``spec`` (same counts of heads, kv heads, experts) that both
    layouts still accept; returns it and ``{field: [full, reduced]}`` for what changed.  With
    ``quantization``, widths of whole 128-blocks (hidden 256, heads of 128) that both layouts
    split on block boundaries."""
    c = spec.config
    block = 128 if quantization else 0
    layer_options = sorted({n for n in (4, 8, 12, 16, 24, 32) if n < c.num_layers} | {c.num_layers})
    for layers in layer_options:
        for mult in (1, 2, 4, 8, 16):
            moe_layers = tuple(l for l in c.moe_layers if l < layers)
            cfg = dataclasses.replace(
                c, num_layers=layers, moe_layers=moe_layers,
                hidden_size=min(c.hidden_size, 2 * block or 128), head_dim=min(c.head_dim, block or 16),
                intermediate_size=min(c.intermediate_size, 128 * mult),
                moe_intermediate_size=min(c.moe_intermediate_size, (block or 64) * mult),
                vocab_size=min(c.vocab_size, 2000))
            small = build_spec(spec.name, cfg)
            try:
                if quantization:  # every rank's shards checked against the blocks
                    q = quantize_spec(small, quantization)
                    if shared_scale_table(q, make_plan(q, src, dst).src):  # trainers cutting blocks: see `cli.run`
                        continue
                else:
                    resolve_layout(src, small, Side.TRAINER)
                    resolve_layout(dst, small, Side.ENGINE)
            except RefitError:
                continue
            changed = {f.name: [getattr(c, f.name), getattr(cfg, f.name)] for f in dataclasses.fields(c)
                       if f.name != "moe_layers" and getattr(c, f.name) != getattr(cfg, f.name)}
            return small, changed
    return spec, {}
