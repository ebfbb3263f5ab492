"""`refit-bench --ray` on a real multi-node Ray cluster on this machine (a head and two worker
nodes of 2 CPUs each, `tests.harness.ray_cluster`): every rank a Ray actor running the direct
bench's worker, over gloo, at reduced width; every destination element verified; bytes within
each node and across nodes reported."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
BENCH = ["--model", "qwen3-30b-moe", "--src", "tp2ep2", "--dst", "tp2", "--iters", "2", "--bucket-mb", "0.25"]


@pytest.fixture(scope="module")
def cluster():
    from tests.harness.ray_cluster import start_cluster, stop_cluster

    c, _ = start_cluster(2)
    try:
        yield c
    finally:
        stop_cluster(c)


def test_disaggregated_json_trainers_and_engines_on_two_nodes(cluster, capsys: pytest.CaptureFixture[str]) -> None:
    """``--ray auto`` inside a process already in the cluster; STRICT_PACK puts the trainers on one
    worker node and the engines on the other, so p2p moves everything across nodes and the
    broadcast planner's stage 0 (trainer to trainer) stays within the trainers' node."""
    from refit.bench import main

    code = main(BENCH + ["--placement", "disaggregated", "--vs", "broadcast", "--ray", "auto",
                         "--ray-strategy", "STRICT_PACK", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verified"] is True and out["transport"] == "gloo" and out["device"] == "cpu"
    assert ray.is_initialized()  # the bench leaves the caller's connection alone
    nodes = out["ray"]["nodes"]
    assert len(nodes) == 2 and sorted(sorted(n["ranks"]) for n in nodes.values()) == \
        [["engine rank 0", "engine rank 1"], ["trainer rank 0", "trainer rank 1"]]
    trainers = next(k for k, n in nodes.items() if "trainer rank 0" in n["ranks"])
    p2p, bcast = out["ray"]["runs"]
    for run, r in zip(out["ray"]["runs"], out["runs"]):
        assert r["verified"] and r["checked_elements"] > 0 and r["mismatches"] == 0
        assert run["total"] == r["moved_bytes"] >= r["dst_bytes"] > 0
    assert p2p["within_node"] == {} and p2p["across_nodes"] == out["runs"][0]["dst_bytes"]
    assert set(bcast["within_node"]) == {trainers} and bcast["within_node"][trainers] > 0
    assert bcast["across_nodes"] >= out["runs"][1]["dst_bytes"]  # stage 1: the trainers' node to the engines'


def test_cli_colocated_spread_over_nodes(cluster) -> None:
    """The command line, joining the cluster by its address: colocated pairs spread over the two
    worker nodes (each pair within its node, shared memory), the rest across."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-m", "refit.bench", *BENCH, "--ray", cluster.address],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "transport gloo" in text and "REDUCED WIDTH" in text
    row = next(line for line in text.splitlines() if line.startswith("p2p "))
    assert row.endswith("yes"), row
    assert f"Ray ({cluster.address}, placement strategy SPREAD): every rank an actor on 2 node(s)" in text
    assert "trainer rank 0; engine rank 0" in text and "trainer rank 1; engine rank 1" in text
    moves = next(line for line in text.splitlines() if "per refit within nodes" in line)
    assert re.search(r"within nodes node \w+ [\d.]+ \w+, node \w+ [\d.]+ \w+; across nodes [1-9]", moves), moves


def test_rank_actor_dying_mid_refit_is_named(cluster, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's test hook: destination rank 1's actor exits during refit 1; the run fails at
    once (exit status 3) naming that rank and its node, and no actor or placement group is left."""
    from refit.bench import main

    monkeypatch.setenv("REFIT_TEST_KILL", "dst1@1")
    code = main(BENCH + ["--ray", "auto", "--timeout", "30"])
    err = capsys.readouterr().err
    assert code == 3 and re.search(r"refit run on Ray failed: engine rank 1 \(node \w{8} [\d.]+\) died", err), err
    assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())


def test_refused_before_anything_starts(cluster, capsys: pytest.CaptureFixture[str]) -> None:
    from refit.bench import main

    # 4 + 4 rank actors of one CPU each; the cluster has 5 CPUs.
    code = main(["--model", "qwen3-30b-moe", "--src", "tp4", "--dst", "tp4", "--ray", "auto"])
    err = capsys.readouterr().err
    assert code == 2 and "puts 8 rank actors of one CPU each on the Ray cluster, which has 5 CPUs" in err
    code = main(BENCH + ["--ray", "auto", "--transport", "ipc"])
    assert code == 2 and "Ray nodes share no memory" in capsys.readouterr().err
    assert ray.util.placement_group_table() == {} or all(
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
    with pytest.raises(SystemExit):
        main(BENCH + ["--ray", "auto", "--via", "grpc"])


# ------------------------------------------------------------------ no cluster: GPU decisions on fake answers


def test_gpu_refusal_and_seats_on_fake_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the driver decides on a GPU cluster, from (faked) cluster resources and the actors'
    answers about where they landed: Ray's isolation (every actor sees its GPU as cuda:0) gives
    each process its own torch index of its GPU and none of the others' (NCCL), and a colocated
    pair that Ray put on two GPUs is refused."""
    from refit.bench import on_ray
    from refit.errors import RefitError
    from refit.executor.topology import Topology
    from refit.plan import Placement

    monkeypatch.setattr(on_ray.ray, "cluster_resources", lambda: {"GPU": 2.0, "CPU": 64.0})
    with pytest.raises(RefitError, match="this plan needs 4 GPUs and the Ray cluster has 2"):
        on_ray._refuse_early(4, 8, True, "auto")
    on_ray._refuse_early(2, 4, True, "auto")

    topo = Topology.one_per_rank(Placement.make("colocated", 2, 2))  # src0, src1, dst0, dst1 on 0, 1, 0, 1
    isolated = [{"host": "h", "uuid": u, "visible": [u], "gpu": g} for u, g in
                (("GPU-b", 1), ("GPU-a", 0), ("GPU-b", 1), ("GPU-a", 0))]  # Ray put bundle 0 on GPU 1
    topos, transport = on_ray._seat(topo, isolated, True, "auto", [], 10.0)
    assert transport == "nccl"
    assert [t.local for t in topos] == [((0, 0), (1, None)), ((0, None), (1, 0))] * 2
    with pytest.raises(RefitError, match="--transport ipc needs every rank on one Ray node"):
        on_ray._seat(topo, isolated, True, "ipc", [], 10.0)
    split = [dict(w) for w in isolated]
    split[2]["uuid"] = "GPU-c"  # engine rank 0 not on its colocated source's GPU
    with pytest.raises(RefitError, match="do not match the plan's placement"):
        on_ray._seat(topo, split, True, "auto", [], 10.0)


# ------------------------------------------------------------------ failures while setting up


class _DiesStarting:
    """A rank actor whose process exits as the driver asks where it runs (as one whose node
    lacks a package, or whose runtime env failed, dies before it answers)."""

    def __init__(self, verbose: bool) -> None:
        pass

    def where(self, cuda: bool) -> dict:
        os._exit(5)


def test_rank_actor_dying_as_it_starts_is_named(cluster, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit status 3 and the rank named, not a RayActorError traceback; nothing left placed."""
    from refit.bench import main, on_ray

    monkeypatch.setattr(on_ray, "_BenchRankActor", ray.remote(max_restarts=0)(_DiesStarting))
    code = main(BENCH + ["--ray", "auto", "--timeout", "60"])
    err = capsys.readouterr().err
    assert code == 3 and re.search(r"refit run on Ray failed: trainer rank 0 died starting \(", err), err
    assert "Traceback" not in err
    assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())


@pytest.mark.parametrize("colocated,fail_at", [(True, 1), (False, 2)])
def test_placement_groups_removed_when_the_wait_is_interrupted(cluster, monkeypatch: pytest.MonkeyPatch,
                                                              colocated: bool, fail_at: int) -> None:
    """Ctrl-C (or any error but a placement timeout) while `rl_placement` waits: every group it
    created is removed (a disaggregated placement's first group too)."""
    from refit.integrations.ray import placement

    real, calls = placement._ready, []

    def ready(*a: object) -> None:
        calls.append(1)
        if len(calls) == fail_at:
            raise KeyboardInterrupt
        real(*a)

    monkeypatch.setattr(placement, "_ready", ready)
    with pytest.raises(KeyboardInterrupt):
        placement.rl_placement(2, 2, colocated=colocated, gpus_per_rank=0, timeout=60)
    assert len(calls) == fail_at
    assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
