"""Elastic engine groups: which engines a plan runs for now, as replicas join, die and come back.

An engine group whose layout is made of whole replicas (a dense model served by vLLM with dp
replicas: `VllmLayout.replicas`) is *elastic*.  Its engines may register under layouts that differ
only in their replica count (a fourth replica starts as ``vllm:tp1dp4`` rank 3 beside three that
registered ``vllm:tp1dp3``), and a plan of the group runs for the replicas that are there:

* a replica is in the plan's *view* when every one of its ranks is registered and none has been
  gone longer than the coordinator's ``drop_after`` (a rank gone for less fails the refit, naming
  it: it may be reconnecting);
* the view's engines play the ranks of the layout with that many replicas, in replica order:
  replicas 0, 2 and 3 of ``vllm:tp1dp4`` refit as ``vllm:tp1dp3`` ranks 0, 1 and 2 (their tensors
  are the same: `interchangeable`); the coordinator plans that layout once and keeps it (the same
  membership gets the same plan back), and tells each member its rank in the rendezvous;
* a catch-up refit runs for the replicas that do not hold the version the plan committed (one
  that joined, one that was replaced): only they receive.

Any other group (MoE, expert parallel, trainers) is rigid: every rank, always.  Pure bookkeeping:
no gRPC, no I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Protocol

from refit.errors import InvalidInput
from refit.layouts import Layout, resolve_layout
from refit.sides import Side
from refit.spec import ModelSpec


class Registered(Protocol):
    """What a view reads of a registered engine: `refit.control.registry.Worker` is one (the
    registry imports this module to tell elastic groups, so it is named here by its shape)."""

    info: Any  # its WorkerInfo: ``group`` and ``rank``
    layout: Layout
    layout_str: str
    worker_id: str
    connected: bool
    left_at: float


def replica_shape(layout: Layout) -> tuple[int, int] | None:
    """(ranks per replica, replicas) of an elastic layout, else None."""
    replicas = getattr(layout, "replicas", None)
    return replicas() if callable(replicas) else None


def within_replica(layout: Layout, rank: int, group: str, members: Collection[str]) -> bool:
    """Whether the engines of ``group`` among a refit's ``members`` (worker ids) are all in the
    replica of ``rank`` of ``layout`` (the whole group for a rigid layout): then no other
    replica's process can have started that refit."""
    shape = replica_shape(layout)
    per = shape[0] if shape is not None else layout.world_size
    ranks = [int(m.rpartition("/")[2]) for m in members if m.rpartition("/")[0] == group]
    return all(r // per == rank // per for r in ranks)


def one_replica(layout: Layout) -> str:
    """What the engines of an elastic group must agree on: their layout with one replica."""
    return layout.with_replicas(1).describe()


_RESOLVED: dict[tuple[str, int, int], tuple[ModelSpec, Layout]] = {}  # `layout_with`'s, by (layout, n, id(spec))
_RESOLVED_MAX = 64


def layout_with(layout: Layout, n: int, spec: ModelSpec) -> Layout:
    """The resolved layout of ``n`` replicas of ``layout``'s kind.  Cached: the coordinator asks
    for its elastic plans' views a few times per refit, and parsing and resolving a layout costs
    more than the rest of a view (the cache holds the spec, so its id stays its own)."""
    key = (layout.describe(), n, id(spec))
    hit = _RESOLVED.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1]
    if len(_RESOLVED) >= _RESOLVED_MAX:
        _RESOLVED.clear()
    resolved = resolve_layout(layout.with_replicas(n).describe(), spec, Side.ENGINE)
    _RESOLVED[key] = (spec, resolved)
    return resolved


def interchangeable(spec: ModelSpec, a: Layout, a_rank: int, b: Layout, b_rank: int) -> bool:
    """Whether rank ``a_rank`` of ``a`` holds exactly the tensors rank ``b_rank`` of ``b`` holds
    (names, shapes, dtypes and the pieces of the model in them): then it can play that rank."""
    return a.local_tensors(spec, a_rank) == b.local_tensors(spec, b_rank)


@dataclass(frozen=True)
class View:
    """The engines a refit of an elastic plan runs for."""

    layout: Layout  # resolved: as many replicas as the view holds
    engines: tuple[Registered, ...]  # in plan-rank order: replica by replica, tp rank within
    replicas: tuple[int, ...]  # the replica index of each of the view's replicas
    left_out: tuple[str, ...]  # worker ids of registered replicas not in it (gone, incomplete, not asked for)

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(w.worker_id for w in self.engines)

    def by_replica(self) -> dict[int, tuple[Registered, ...]]:
        """The engines of each of the view's replicas, by replica index (tp ranks in order)."""
        tp = len(self.engines) // len(self.replicas)
        return {idx: self.engines[i * tp:(i + 1) * tp] for i, idx in enumerate(self.replicas)}


def engine_view(engines: Iterable[Registered], spec: ModelSpec, drop_after: float | None,
                only: Collection[int] | None = None, now: float | None = None) -> View:
    """The view of an elastic group's registered engines (rows of one group, one replica shape):
    whole replicas whose ranks are connected or gone for at most ``drop_after`` seconds (None:
    never dropped); ``only``: just these replica indices (a catch-up).  Raises `InvalidInput`
    when no replica is left."""
    now = time.monotonic() if now is None else now
    rows = list(engines)
    tp = replica_shape(rows[0].layout)[0]
    by_replica: dict[int, dict[int, Registered]] = {}
    for w in rows:
        by_replica.setdefault(w.info.rank // tp, {})[w.info.rank % tp] = w
    kept, left_out, why = [], [], []
    for idx in sorted(by_replica):
        ranks = by_replica[idx]
        gone = [w for w in ranks.values() if not w.connected and drop_after is not None
                and now - w.left_at >= drop_after]
        missing = [idx * tp + t for t in range(tp) if t not in ranks]
        if missing or gone or (only is not None and idx not in only):
            left_out += [ranks[t].worker_id for t in sorted(ranks)]
            why += [f"rank {r} of {ranks[min(ranks)].layout_str} is not registered" for r in missing]
            why += [f"{w.worker_id} has been gone {now - w.left_at:.0f} s" for w in gone]
        else:
            kept.append(idx)
    if not kept:
        group = rows[0].info.group
        raise InvalidInput(f"engine group {group!r} has no whole replica to refit: {'; '.join(why) or 'none asked for'}")
    layout = layout_with(rows[0].layout, len(kept), spec)
    ordered = tuple(by_replica[idx][t] for idx in kept for t in range(tp))
    return View(layout, ordered, tuple(kept), tuple(left_out))

