"""Placement groups for an RL job's trainer and engine actors, in refit's two placements.

* colocated: trainer rank i and engine rank i share bundle i (one node, one GPU: each actor asks
  half the bundle's GPU, so Ray gives both the same one);
* disaggregated: trainers in one placement group, engines in another (their own GPUs).

`RLPlacement.create_plan` tells the coordinator the placement built, after checking that the
registered workers sit where it says (`check_placement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from refit.errors import InvalidInput

if TYPE_CHECKING:
    from refit.control.client import Client
    from refit.plan import Plan

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Ray leaves CUDA_VISIBLE_DEVICES alone in actors started with this set.
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


@dataclass
class RLPlacement:
    """The placement groups built by `rl_placement`, and the actor options that put each rank in
    its bundle."""

    placement: str  # "colocated" or "disaggregated": refit's name for it
    num_trainers: int
    num_engines: int
    gpus_per_rank: float
    cpus_per_rank: float
    trainer_group: PlacementGroup
    engine_group: PlacementGroup  # the same group when colocated
    all_gpus_visible: bool = False  # GPU ranks see every GPU of their node (see `rl_placement`)

    def _options(self, group: PlacementGroup, rank: int, count: int, what: str) -> dict[str, Any]:
        if not 0 <= rank < count:
            raise InvalidInput(f"{what} rank {rank} is outside 0..{count - 1}")
        share = 0.5 if self.placement == "colocated" else 1.0  # colocated: two actors per GPU
        opts: dict[str, Any] = {"num_cpus": self.cpus_per_rank, "num_gpus": self.gpus_per_rank * share,
                                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                                    group, placement_group_bundle_index=rank)}
        if self.all_gpus_visible and self.gpus_per_rank:
            opts["runtime_env"] = {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}
        return opts

    def trainer_options(self, rank: int) -> dict[str, Any]:
        """Keyword arguments for ``TrainerActor.options(...)`` of trainer ``rank``."""
        return self._options(self.trainer_group, rank, self.num_trainers, "trainer")

    def engine_options(self, rank: int) -> dict[str, Any]:
        """Keyword arguments for ``EngineActor.options(...)`` of engine ``rank``."""
        return self._options(self.engine_group, rank, self.num_engines, "engine")

    def create_plan(self, client: "Client", trainer_group: str, engine_group: str, **kwargs: Any) -> dict[str, Any]:
        """`Client.create_plan` with this placement, once the registered workers agree with it."""
        check_placement(client, trainer_group, engine_group, self.placement)
        return client.create_plan(trainer_group, engine_group, placement=self.placement, **kwargs)

    def remove(self) -> None:
        """Remove the placement groups (the actors in them die)."""
        for group in {self.trainer_group.id: self.trainer_group, self.engine_group.id: self.engine_group}.values():
            remove_placement_group(group)


def _bundle(gpus: float, cpus: float) -> dict[str, float]:
    return {"GPU": gpus, "CPU": cpus} if gpus else {"CPU": cpus}


def _ready(group: PlacementGroup, bundles: list[dict[str, float]], timeout: float) -> None:
    """Wait for ``group``; a timeout is a `RefitError` (the caller removes the group)."""
    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise InvalidInput(f"a placement group of {len(bundles)} bundles {bundles[0]} was not placed within "
                         f"{timeout:g} s; the cluster has {ray.available_resources()} available") from None


def rl_placement(num_trainers: int, num_engines: int, *, colocated: bool = True, gpus_per_rank: float = 1,
                 cpus_per_rank: float = 1, strategy: str = "PACK", all_gpus_visible: bool = False,
                 timeout: float = 120.0) -> RLPlacement:
    """Build (and wait for) the placement groups for ``num_trainers`` trainer and ``num_engines``
    engine ranks, one GPU each (``gpus_per_rank=0`` on CPU-only clusters).  Colocated: bundle i holds
    trainer i and engine i (a rank beyond the other side's count has its bundle alone).
    ``strategy``: Ray's bundle strategy within a group (PACK fills nodes first).

    ``all_gpus_visible``: start GPU ranks with every GPU of their node visible (Ray's
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES), so that torch's index of a GPU is the node's and
    refit's data plane, which tells GPUs of one host apart by that index, sees distinct GPUs as
    distinct; each rank must then ``torch.cuda.set_device(refit_ray.endpoint().cuda_index)``."""
    if num_trainers < 1 or num_engines < 1:
        raise InvalidInput(f"need at least one trainer and one engine rank, got {num_trainers} and {num_engines}")
    if gpus_per_rank < 0 or cpus_per_rank < 0 or gpus_per_rank + cpus_per_rank == 0:
        raise InvalidInput(f"a rank needs some resources, got gpus_per_rank={gpus_per_rank} "
                         f"cpus_per_rank={cpus_per_rank}")
    if colocated and gpus_per_rank > 1:
        raise InvalidInput(f"colocated ranks share one GPU per bundle: gpus_per_rank must be at most 1, "
                         f"got {gpus_per_rank}")
    if strategy not in STRATEGIES:
        raise InvalidInput(f"unknown placement group strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    if colocated:
        # Both actors of a bundle ask half its GPU; CPUs are counted per actor.
        bundles = [_bundle(gpus_per_rank, cpus_per_rank * ((i < num_trainers) + (i < num_engines)))
                   for i in range(max(num_trainers, num_engines))]
        group = placement_group(bundles, strategy=strategy)
        try:
            _ready(group, bundles, timeout)
        except BaseException:  # Ctrl-C, a lost connection: no group outlives the call that failed
            remove_placement_group(group)
            raise
        return RLPlacement("colocated", num_trainers, num_engines, gpus_per_rank, cpus_per_rank, group, group,
                           all_gpus_visible)
    groups: list[PlacementGroup] = []
    try:
        for count in (num_trainers, num_engines):
            bundles = [_bundle(gpus_per_rank, cpus_per_rank)] * count
            groups.append(placement_group(bundles, strategy=strategy))
            _ready(groups[-1], bundles, timeout)
    except BaseException:  # the other side's group too (it was only removed on a placement timeout)
        for g in groups:
            remove_placement_group(g)
        raise
    return RLPlacement("disaggregated", num_trainers, num_engines, gpus_per_rank, cpus_per_rank, *groups,
                       all_gpus_visible)


def check_placement(client: "Client", trainer_group: str, engine_group: str, placement: str) -> None:
    """Refuse (`RefitError`) registered workers that contradict ``placement``: colocated pairs
    (trainer i, engine i) on different hosts or GPUs; disaggregated ranks sharing a GPU."""
    if placement not in ("colocated", "disaggregated"):
        raise InvalidInput(f"unknown placement {placement!r}: colocated or disaggregated")
    where: dict[tuple[str, int], tuple[str, int]] = {}
    for group in (trainer_group, engine_group):
        for row in client.list_workers(group=group):
            info = row["info"]
            if row["connected"]:
                where[(group, info["rank"])] = (info["host"], info["gpu"])
    trainers = {r: w for (g, r), w in where.items() if g == trainer_group}
    engines = {r: w for (g, r), w in where.items() if g == engine_group}
    if placement == "colocated":
        for r in sorted(set(trainers) & set(engines)):
            (th, tg), (eh, eg) = trainers[r], engines[r]
            if th != eh or tg != eg:
                raise InvalidInput(f"colocated placement, but {trainer_group}/{r} is on host {th} GPU {tg} and "
                                 f"{engine_group}/{r} on host {eh} GPU {eg}")
        return
    engine_gpus = {w: r for r, w in engines.items() if w[1] >= 0}
    for r, w in sorted(trainers.items()):
        if w in engine_gpus:
            raise InvalidInput(f"disaggregated placement, but {trainer_group}/{r} and {engine_group}/{engine_gpus[w]} "
                             f"share GPU {w[1]} on host {w[0]}")


@dataclass(frozen=True)
class Traffic:
    """The bytes a plan moves per refit, by where its ends sit."""

    within: dict[str, int]  # host -> bytes whose sender and receiver are both on that host
    across: int             # bytes between two hosts

    @property
    def total(self) -> int:
        return sum(self.within.values()) + self.across


def plan_traffic(client: "Client", plan_id: str) -> Traffic:
    """Where a plan's bytes go, by the hosts its workers registered (a Ray node each, see
    `refit.integrations.ray.endpoint`): per host, and across hosts.  Every bucket counts, the
    broadcast planner's stage 0 (trainer to trainer) too."""
    summary = client.get_plan(plan_id, include_plan=True)
    hosts: dict[str, dict[int, str]] = {}
    for side in ("src_group", "dst_group"):
        group = summary[side]
        hosts[side] = {row["info"]["rank"]: row["info"]["host"] for row in client.list_workers(group=group)}
    return traffic(summary["plan"], hosts["src_group"], hosts["dst_group"])


def traffic(plan: "Plan", src_host: Mapping[int, str], dst_host: Mapping[int, str]) -> Traffic:
    """`Traffic` of ``plan`` with source rank r on host ``src_host[r]`` and destination rank r on
    ``dst_host[r]`` (pure)."""
    within: dict[str, int] = {}
    across = 0
    for b in plan.buckets:
        sender = src_host[b.sender]
        receiver = (src_host if b.stage == 0 else dst_host)[b.receiver]
        if sender == receiver:
            within[sender] = within.get(sender, 0) + b.nbytes
        else:
            across += b.nbytes
    return Traffic(within, across)
