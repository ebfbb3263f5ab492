"""Phased plans: one plan cut into windows of layers, refitted one window after another.

An engine that must re-process what it receives (repack, re-quantize) stages every received tensor
until the refit ends; over a whole model that is the whole shard.  A *phased* plan bounds it: its
buckets are grouped by *phase*, all members run phase 1, the engine applies it (its `PhaseHook`'s
``landed``), then phase 2, and so on.  Only one phase's tensors are ever staged.

Phase keys (`phase_key`): every tensor without layers (embeddings, final norm, LM head) is a phase
of its own, numbered ``0..m-1`` in spec order; a stacked per-layer tensor's row of global layer
``l`` belongs to phase ``m + l // layers_per_phase``.  Phases run in increasing key order; inside
a phase, buckets are packed exactly as an unphased plan's (`refit.plan.pack_buckets`).

Pure data: no torch.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from refit.errors import InvalidInput
from refit.plan import WHOLE, Bucket, Plan, Transfer, pack_buckets
from refit.spec import ModelSpec, TensorSpec

__all__ = ["WHOLE", "phase_key", "phase_plan"]


def _non_layer_index(spec: ModelSpec) -> dict[str, int]:
    return {t.name: i for i, t in enumerate(x for x in spec.tensors if not x.layers)}


def _tensor_keys(t: TensorSpec, singles: dict[str, int], layers_per_phase: int) -> list[int] | int:
    """The phase key of every row (dim 0) of ``t``, or its one key when it has no layers."""
    if not t.layers:
        return singles[t.name]
    return [len(singles) + layer // layers_per_phase for layer in t.layers]


def phase_key(spec: ModelSpec, tensor: str, pos: int, layers_per_phase: int) -> int:
    """The phase of row ``pos`` (index along dim 0) of canonical ``tensor``; ``pos`` is ignored
    for a tensor without layers."""
    if layers_per_phase <= 0:
        raise InvalidInput(f"layers_per_phase must be positive, got {layers_per_phase}")
    keys = _tensor_keys(spec[tensor], _non_layer_index(spec), layers_per_phase)
    return keys if isinstance(keys, int) else keys[pos]


def _split_by_phase(t: Transfer, keys: list[int] | int) -> list[tuple[int, Transfer]]:
    """``t`` cut along dim 0 where its rows change phase; ``keys``: the key of every row of its
    tensor (a list), or the one key of a tensor without layers."""
    if isinstance(keys, int):
        return [(keys, t)]
    out: list[tuple[int, Transfer]] = []
    first, end = t.start[0], t.start[0] + t.size[0]
    run = first
    for pos in range(first + 1, end + 1):
        if pos == end or keys[pos] != keys[run]:
            start = (run,) + t.start[1:]
            size = (pos - run,) + t.size[1:]
            out.append((keys[run], t if (run, pos) == (first, end) else t._replace(start=start, size=size)))
            run = pos
    return out


def phase_plan(plan: Plan, spec: ModelSpec, layers_per_phase: int) -> Plan:
    """``plan`` cut into phases of ``layers_per_phase`` layers (see the module docstring); the
    same elements move.  ``layers_per_phase <= 0``: ``plan`` itself."""
    if layers_per_phase <= 0:
        return plan
    if plan.gathers:
        raise InvalidInput(f"a {plan.planner} plan gathers whole tensors on source roots and cannot be cut "
                         f"into phases (phase_layers={layers_per_phase}); use the p2p planner")
    if plan.phase_layers:
        raise InvalidInput(f"plan {plan.plan_hash} is already phased ({plan.phase_layers} layers per phase)")
    singles = _non_layer_index(spec)
    row_keys = {t.name: _tensor_keys(t, singles, layers_per_phase) for t in spec.tensors}
    by_phase: dict[int, list[Transfer]] = defaultdict(list)
    for t in plan.transfers:
        for key, piece in _split_by_phase(t, row_keys[t.tensor]):
            by_phase[key].append(piece)

    transfers: list[Transfer] = []
    buckets: list[Bucket] = []
    phases: list[tuple[int, int]] = []
    for key in sorted(by_phase):
        ts, bs = pack_buckets(by_phase[key], plan.tensors, plan.bucket_bytes, plan.placement.src_gpus,
                              plan.placement.dst_gpus)
        phases.append((key, len(buckets)))
        shift = len(transfers)
        transfers.extend(ts)
        buckets.extend(b._replace(first=b.first + shift) for b in bs)
    return dataclasses.replace(plan, transfers=tuple(transfers), buckets=tuple(buckets),
                               phase_layers=layers_per_phase, phases=tuple(phases))
