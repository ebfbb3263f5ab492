"""A real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head and worker
nodes, each its own raylet) and the trainer / engine rank actors the Ray tests place on it.

A rank actor holds its local tensors of the tiny Qwen3-MoE (filled as tests/control_cluster.py
does, so an engine can check bit for bit that it holds version v) and runs an unchanged
`TrainerAgent` / `EngineAgent` whose address, token, host and GPU come from
`refit.integrations.ray.agent_kwargs()`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray
import torch

from refit.control.agent import EngineAgent, TrainerAgent
from refit.integrations import ray as refit_ray
from refit.layouts import resolve_layout
from refit.sides import Side
from tests.harness.control_cluster import MODEL, HookedDataPlane, fill
from tests.harness.tiny import tiny_spec

# Fast node-death detection, so that a removed node's placement-group bundles move on quickly.
HEAD_ARGS = {"num_cpus": 1, "include_dashboard": False,
             "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4}}
NODE_CPUS = 2

log = logging.getLogger(__name__)


class RankActor:
    """One trainer or engine rank as a Ray actor (restartable: ``__init__`` registers again)."""

    def __init__(self, role: str, group: str, rank: int, layout: str, version: int = 0) -> None:
        spec = tiny_spec(MODEL)
        self.spec, self.rank = spec, rank
        self.layout = resolve_layout(layout, spec, Side.named(role))
        self.tensors = fill(spec, self.layout, rank, version)
        self.dp = HookedDataPlane(threading.Event())
        cls = TrainerAgent if role == "trainer" else EngineAgent
        self.agent = cls(**refit_ray.agent_kwargs(), group=group, rank=rank, spec=spec, layout=self.layout,
                         tensors=self.tensors, data_plane=self.dp,
                         version=version if role == "engine" else 0).start(timeout=120)

    def endpoint(self) -> refit_ray.RayEndpoint:
        return refit_ray.endpoint()

    def coordinator_address(self) -> str:
        return refit_ray.coordinator_address()

    def fill(self, version: int) -> None:
        fill(self.spec, self.layout, self.rank, version, self.tensors)

    def check(self, version: int) -> list[str]:
        """Local tensors that differ from ``version``'s, bit for bit."""
        want = fill(self.spec, self.layout, self.rank, version)
        return [n for n in want if not torch.equal(want[n].view(torch.int16), self.tensors[n].view(torch.int16))]

    def delay(self, version: int, seconds: float) -> None:
        """Sleep ``seconds`` in the data plane before ``version``'s share."""
        self.dp.delays[version] = seconds
        self.dp.entered.clear()

    def fault(self, version: int, action: str) -> None:
        """Strike this rank once the first phase of ``version``'s share landed on every member
        (an `AfterFirstPhase` action; unphased plans: once the whole plan landed, before it answers)."""
        self.dp.faults[version] = action
        self.dp.entered.clear()

    def entered(self) -> bool:
        return self.dp.entered.is_set()

    def state(self) -> tuple[int, bool, bool]:
        return self.agent.version, self.agent.stale, self.agent.connected


# Restartable once per kill the tests make; a killed actor's restart re-runs __init__ (re-registers).
RankActorRemote = ray.remote(max_restarts=4, max_task_retries=0)(RankActor)


# Ray waits a fixed 30 s for a new raylet (or GCS) to come up.  On a loaded 2-core machine that has
# run out (a fresh-clone CI run: "The current node timed out during startup"), so a start that
# timed out is retried on a fresh cluster; any other failure is raised at once.
STARTS = 3


def start_cluster(num_nodes: int = 2) -> tuple[Any, list[Any]]:
    """A head (the coordinator's node) and ``num_nodes`` worker nodes; the driver connected."""
    for attempt in range(1, STARTS):
        try:
            return _start_cluster(num_nodes)
        except Exception as e:
            if "timed out" not in str(e).lower():
                raise
            log.warning("Ray cluster start %d of %d timed out (%s); starting a fresh one", attempt, STARTS, e)
            time.sleep(5)
    return _start_cluster(num_nodes)


def _start_cluster(num_nodes: int) -> tuple[Any, list[Any]]:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=HEAD_ARGS)
    try:
        nodes = [cluster.add_node(num_cpus=NODE_CPUS) for _ in range(num_nodes)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, logging_level="warning", log_to_driver=False)
    except BaseException:
        ray.shutdown()
        cluster.shutdown()
        raise
    return cluster, nodes


def stop_cluster(cluster: Any) -> None:
    try:
        ray.shutdown()
    finally:
        cluster.shutdown()
