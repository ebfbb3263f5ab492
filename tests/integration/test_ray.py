"""refit inside a Ray job, on a real multi-node Ray cluster on this machine (a head and two worker
nodes, each its own raylet; CPU only, gloo): the coordinator as a named actor on the head, trainer
and engine ranks as actors placed by `rl_placement`, unchanged agents inside them, bit-exact
repeated refits, and the faults a Ray job sees (an actor killed, a node removed).

The tests of the shared cluster run in file order (versions only go up).  The live vLLM engine as
a Ray actor is not here: it needs the vLLM backend (another issue)."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

import grpc
import pytest

ray = pytest.importorskip("ray")

from refit.control.client import Client, RefitResult  # noqa: E402
from refit.errors import RefitError  # noqa: E402
from refit.integrations import ray as refit_ray  # noqa: E402
from tests.harness.control_cluster import DST, SRC  # noqa: E402
from tests.harness.ray_cluster import NODE_CPUS  # noqa: E402

BYTES_PER_REFIT = 150400  # the tiny Qwen3-MoE, megatron:tp2ep2 -> vllm:tp2
# Deadline of the refits the fault tests break.  The survivors of a broken refit sit in their
# share until its deadline, so the next refit waits that long: short, yet far above the few
# seconds Ray takes to kill an actor on a loaded 2-core machine.
REFIT_TIMEOUT = 20.0


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.2)


# ------------------------------------------------------------------ no cluster needed


def test_host_for_gives_each_node_of_one_machine_its_own_loopback_address() -> None:
    a, b = "a" * 56, "b" * 56
    assert refit_ray.host_for(a, "10.1.2.3", one_machine=False) == "10.1.2.3"
    ha, hb = refit_ray.host_for(a, "10.1.2.3", True), refit_ray.host_for(b, "10.1.2.3", True)
    assert ha != hb and ha == refit_ray.host_for(a, "192.0.2.9", True)
    for h in (ha, hb):
        octets = [int(x) for x in h.split(".")]
        assert octets[0] == 127 and 1 <= octets[3] <= 254 and all(0 <= x <= 255 for x in octets)


def test_cuda_index_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")  # as Ray sets it for an actor given GPUs 3 and 1
    assert (refit_ray.cuda_index(3), refit_ray.cuda_index(1), refit_ray.cuda_index(-1)) == (0, 1, -1)
    with pytest.raises(RefitError, match="GPU 2 is not in CUDA_VISIBLE_DEVICES=3,1"):
        refit_ray.cuda_index(2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: all visible
    assert refit_ray.cuda_index(2) == 2


def test_bad_placement_requests_are_refused() -> None:
    with pytest.raises(RefitError, match="at least one trainer and one engine rank, got 0 and 2"):
        refit_ray.rl_placement(0, 2)
    with pytest.raises(RefitError, match="gpus_per_rank=0 cpus_per_rank=0"):
        refit_ray.rl_placement(2, 2, gpus_per_rank=0, cpus_per_rank=0)
    with pytest.raises(RefitError, match="gpus_per_rank must be at most 1, got 2"):
        refit_ray.rl_placement(2, 2, colocated=True, gpus_per_rank=2)
    with pytest.raises(RefitError, match="unknown placement group strategy 'TIGHT'"):
        refit_ray.rl_placement(2, 2, strategy="TIGHT")


def test_check_placement_against_registered_workers(make_coordinator) -> None:
    """Against a real coordinator with (data-plane-less) agents registered where we say they are."""
    from refit.control.agent import EngineAgent, TrainerAgent
    from refit.control.dataplane import NoopDataPlane
    from tests.harness.tiny import tiny_spec

    srv, c = make_coordinator()
    agents = []

    def register(cls: type, group: str, rank: int, layout: str, host: str, gpu: int) -> None:
        agents.append(cls(srv.address, group=group, rank=rank, spec=tiny_spec("tiny-qwen3-moe"), layout=layout,
                          data_plane=NoopDataPlane(), host=host, gpu=gpu).start())

    try:
        for r in range(2):
            register(TrainerAgent, "t", r, "megatron:tp2", "10.0.0.1", r)
            register(EngineAgent, "e", r, "vllm:tp2", "10.0.0.1", r)  # colocated: same host and GPU
            register(EngineAgent, "d", r, "vllm:tp2", "10.0.0.2", r)  # another host
        refit_ray.check_placement(c, "t", "e", "colocated")
        refit_ray.check_placement(c, "t", "d", "disaggregated")
        with pytest.raises(RefitError, match="t/0 and e/0 share GPU 0 on host 10.0.0.1"):
            refit_ray.check_placement(c, "t", "e", "disaggregated")
        with pytest.raises(RefitError, match="t/0 is on host 10.0.0.1 GPU 0 and d/0 on host 10.0.0.2 GPU 0"):
            refit_ray.check_placement(c, "t", "d", "colocated")
        with pytest.raises(RefitError, match="unknown placement 'sideways'"):
            refit_ray.check_placement(c, "t", "d", "sideways")
        # Traffic by host: the broadcast planner's stage 0 stays among the trainers' host.
        plan = c.create_plan("t", "d", placement="disaggregated", planner="broadcast")
        buckets = c.get_plan(plan["plan_id"], include_plan=True)["plan"].buckets
        stage0, stage1 = (sum(b.nbytes for b in buckets if b.stage == s) for s in (0, 1))
        assert stage0 > 0 and refit_ray.plan_traffic(c, plan["plan_id"]) == \
            refit_ray.Traffic({"10.0.0.1": stage0}, stage1)
        plan = c.create_plan("t", "e", placement="colocated")
        assert refit_ray.plan_traffic(c, plan["plan_id"]) == refit_ray.Traffic({"10.0.0.1": plan["total_bytes"]}, 0)
    finally:
        for a in agents:
            a.stop()


def test_needs_ray_init() -> None:
    if ray.is_initialized():
        pytest.skip("Ray already initialized in this process")
    with pytest.raises(RefitError, match="ray.init"):
        refit_ray.start_coordinator()


# ------------------------------------------------------------------ one cluster for the rest


class RayJob:
    """Trainer and engine rank actors of one placement, and the plan between their groups."""

    def __init__(self, client: Client, pl: refit_ray.RLPlacement, tgroup: str, egroup: str) -> None:
        from tests.harness.ray_cluster import RankActorRemote

        self.client, self.pl, self.tgroup, self.egroup = client, pl, tgroup, egroup
        self.trainers = [RankActorRemote.options(**pl.trainer_options(r)).remote("trainer", tgroup, r, SRC)
                         for r in range(2)]
        self.engines = [RankActorRemote.options(**pl.engine_options(r)).remote("engine", egroup, r, DST)
                        for r in range(2)]
        ray.get([a.state.remote() for a in self.trainers + self.engines], timeout=300)  # all registered
        self.plan_id = pl.create_plan(client, tgroup, egroup, bucket_bytes=4096)["plan_id"]
        self.version = 0  # last version committed

    def endpoints(self, actors: list[Any]) -> list[refit_ray.RayEndpoint]:
        return ray.get([a.endpoint.remote() for a in actors], timeout=60)

    def fill(self, version: int) -> None:
        ray.get([a.fill.remote(version) for a in self.trainers], timeout=60)

    def check_engines(self, version: int) -> None:
        assert ray.get([a.check.remote(version) for a in self.engines], timeout=60) == [[], []]
        # each engine hears the commit just after the refit returns
        states = lambda: ray.get([a.state.remote() for a in self.engines], timeout=60)  # noqa: E731
        wait_for(lambda: states() == [(version, False, True)] * 2, 10, f"the engines to hold version {version}")
        rows = self.client.list_workers(group=self.egroup)
        assert [(r["version"], r["stale"]) for r in rows] == [(version, False)] * 2

    def refit_ok(self, version: int) -> None:
        self.fill(version)
        result = self.client.refit(self.plan_id, version=version, timeout=60.0)
        assert result.ok and result.total_bytes == BYTES_PER_REFIT, result
        self.version = version
        self.check_engines(version)

    def engines_stale(self, dead: tuple[int, ...] = ()) -> None:
        """Every engine's row is stale; the live engines (not ``dead``) say so themselves."""
        assert all(r["stale"] for r in self.client.list_workers(group=self.egroup))
        live = [a for r, a in enumerate(self.engines) if r not in dead]
        for version, stale, connected in ray.get([a.state.remote() for a in live], timeout=60):
            assert stale and connected and version == self.version

    def sessions(self, group: str) -> dict[str, str]:
        return {r["worker_id"]: r["session"] for r in self.client.list_workers(group=group) if r["connected"]}

    def refit_in_background(self, version: int, timeout: float) -> tuple[threading.Thread, dict[str, RefitResult]]:
        out: dict[str, RefitResult] = {}
        t = threading.Thread(target=lambda: out.update(r=self.client.refit(self.plan_id, version=version,
                                                                            timeout=timeout, check=False)))
        t.start()
        return t, out


@pytest.fixture(scope="module")
def ray_job():
    from tests.harness.ray_cluster import start_cluster, stop_cluster

    cluster, nodes = start_cluster(2)
    client = None
    try:
        address = refit_ray.start_coordinator()
        client = Client(address)
        # Trainers fill one worker node, engines the other (each group needs a whole 2-CPU node).
        pl = refit_ray.rl_placement(2, 2, colocated=False, gpus_per_rank=0, cpus_per_rank=1, strategy="STRICT_PACK")
        job = RayJob(client, pl, "trainer", "engine")
        job.cluster, job.address = cluster, address
        yield job
    finally:
        if client is not None:
            client.close()
        stop_cluster(cluster)


@pytest.mark.slow
def test_coordinator_is_one_named_actor(ray_job: RayJob) -> None:
    assert refit_ray.start_coordinator() == ray_job.address  # idempotent
    assert ray.get(ray_job.engines[0].coordinator_address.remote(), timeout=60) == ray_job.address
    with pytest.raises(RefitError, match="already runs at .* with no token"):
        refit_ray.start_coordinator(token="s3cret")
    head = ray_job.cluster.head_node
    assert ray_job.address.rsplit(":", 1)[0] == head.node_ip_address
    assert ray.get(ray.get_actor(refit_ray.COORDINATOR_NAME).node_id.remote(), timeout=60) == head.node_id
    # A second coordinator, detached, with a token: agents inside actors get it with the address.
    address = refit_ray.start_coordinator(token="s3cret", name="refit-token", detached=True)
    try:
        kwargs = ray.get(ray.remote(num_cpus=0)(lambda: refit_ray.agent_kwargs(name="refit-token")).remote(),
                         timeout=120)
        assert kwargs["address"] == address != ray_job.address and kwargs["token"] == "s3cret"
        with Client(address, token="s3cret") as c:
            assert c.health() == "SERVING"
        with Client(address) as c, pytest.raises(grpc.RpcError) as e:
            c.health()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        refit_ray.stop_coordinator(name="refit-token")
    with pytest.raises(RefitError, match="no refit coordinator actor 'refit-token'"):
        refit_ray.coordinator_address(name="refit-token")
    # One whose stop hangs is killed, without raising (it raised GetTimeoutError).
    hung = ray.remote(num_cpus=0)(_HungStop).options(name="refit-hung").remote()
    ray.get(hung.ping.remote(), timeout=60)
    refit_ray.stop_coordinator(name="refit-hung", timeout=0.5)
    with pytest.raises(ValueError):
        ray.get_actor("refit-hung")


class _HungStop:
    """A named actor whose ``stop`` never returns (a coordinator stuck in its shutdown)."""

    def ping(self) -> bool:
        return True

    def stop(self) -> None:
        import time

        time.sleep(3600)


@pytest.mark.slow
def test_disaggregated_across_nodes_bit_exact(ray_job: RayJob) -> None:
    trainers, engines = ray_job.endpoints(ray_job.trainers), ray_job.endpoints(ray_job.engines)
    assert len({e.node_id for e in trainers}) == 1 and len({e.node_id for e in engines}) == 1
    assert trainers[0].node_id != engines[0].node_id and trainers[0].host != engines[0].host
    assert all(e.gpu == -1 for e in trainers + engines)
    rows = {r["worker_id"]: r["info"] for r in ray_job.client.list_workers()}
    assert [rows[f"trainer/{r}"]["host"] for r in range(2)] == [trainers[0].host] * 2
    assert [rows[f"engine/{r}"]["host"] for r in range(2)] == [engines[0].host] * 2
    assert ray_job.client.get_plan(ray_job.plan_id)["placement"] == "disaggregated"
    # These groups are not colocated: the placement check says where they are.
    with pytest.raises(RefitError, match=f"colocated placement, but trainer/0 is on host {trainers[0].host}"):
        refit_ray.check_placement(ray_job.client, "trainer", "engine", "colocated")
    assert refit_ray.plan_traffic(ray_job.client, ray_job.plan_id) == refit_ray.Traffic({}, BYTES_PER_REFIT)
    for v in (1, 2, 3):
        ray_job.refit_ok(v)


@pytest.mark.slow
@pytest.mark.parametrize("role", ["trainer", "engine"])
def test_actor_killed_mid_refit(ray_job: RayJob, role: str) -> None:
    v = ray_job.version + 1
    group, actors = (ray_job.tgroup, ray_job.trainers) if role == "trainer" else (ray_job.egroup, ray_job.engines)
    victim, name = actors[1], f"{group}/1"
    before = ray_job.sessions(group)
    # The victim holds in its phase hook once every member finished writing the plan (unphased:
    # all of it), before it answers; killed there, by Ray, the refit must not commit.
    ray.get(victim.fault.remote(v, "hold"), timeout=60)
    ray_job.fill(v)
    t0 = time.monotonic()
    t, out = ray_job.refit_in_background(v, timeout=REFIT_TIMEOUT)
    wait_for(lambda: ray.get(victim.entered.remote(), timeout=30), 30, f"{name} to finish writing its share")
    ray.kill(victim, no_restart=False)
    t.join(45)
    result = out["r"]
    assert not result.ok and time.monotonic() - t0 < REFIT_TIMEOUT, result
    assert result.workers[name].outcome == "disconnected", result
    assert result.error.split(": ", 1)[1].startswith(f"{name} disconnected"), result.error
    ray_job.engines_stale(dead=(1,) if role == "engine" else ())
    live = ray_job.engines[:1] if role == "engine" else ray_job.engines
    assert ray.get([a.check.remote(v) for a in live], timeout=60) == [[]] * len(live)  # all of v landed, uncommitted
    # Ray restarts the actor; its __init__ registers again (an engine with its initial weights)
    # and the plan works again.
    wait_for(lambda: ray_job.sessions(group).get(name, before[name]) != before[name], 180,
             f"the restarted {name} to re-register")
    ray_job.refit_ok(v)


@pytest.mark.slow
def test_node_removed_mid_refit(ray_job: RayJob) -> None:
    v = ray_job.version + 1
    node_id = ray_job.endpoints(ray_job.trainers)[0].node_id
    node = next(n for n in ray_job.cluster.worker_nodes if n.node_id == node_id)
    before = ray_job.sessions("trainer")
    # Both trainers hold in their phase hooks once every member finished writing the plan,
    # before they answer; their node goes then.
    ray.get([a.fault.remote(v, "hold") for a in ray_job.trainers], timeout=60)
    ray_job.fill(v)
    t0 = time.monotonic()
    t, out = ray_job.refit_in_background(v, timeout=REFIT_TIMEOUT)
    wait_for(lambda: all(ray.get([a.entered.remote() for a in ray_job.trainers], timeout=30)), 30,
             "both trainers to finish writing their shares")
    ray_job.cluster.remove_node(node)  # the trainers' node: both trainer actors die with it
    try:
        t.join(45)
        result = out["r"]
        assert not result.ok and time.monotonic() - t0 < REFIT_TIMEOUT, result
        assert result.error.split(": ", 1)[1].startswith("trainer/"), result.error
        # The raylet ends its workers one by one: a trainer may first report its peer's loss, or
        # (a loaded machine) still be alive when the failure's grace ends (abandoned: "unspecified").
        trainers = {w: r.outcome for w, r in result.workers.items() if r.role == "trainer"}
        assert "disconnected" in trainers.values() and \
            set(trainers.values()) <= {"disconnected", "error", "unspecified"}, result
        ray_job.engines_stale()
    finally:  # a new node takes the trainers' placement-group bundles; Ray restarts the actors there
        new = ray_job.cluster.add_node(num_cpus=NODE_CPUS)
    wait_for(lambda: all(ray_job.sessions("trainer").get(w, s) != s for w, s in before.items()),
             240, "both trainers to re-register on the new node")
    assert {e.node_id for e in ray_job.endpoints(ray_job.trainers)} == {new.node_id}
    ray_job.refit_ok(v)


@pytest.mark.slow
def test_colocated_bit_exact(ray_job: RayJob) -> None:
    # Small CPU shares: both bundles fit next to the running disaggregated job.
    pl = refit_ray.rl_placement(2, 2, colocated=True, gpus_per_rank=0, cpus_per_rank=0.25)
    try:
        job = RayJob(ray_job.client, pl, "co-trainer", "co-engine")
        trainers, engines = job.endpoints(job.trainers), job.endpoints(job.engines)
        assert [e.node_id for e in trainers] == [e.node_id for e in engines]
        assert job.client.get_plan(job.plan_id)["placement"] == "colocated"
        assert refit_ray.plan_traffic(job.client, job.plan_id) == \
            refit_ray.Traffic({trainers[0].host: BYTES_PER_REFIT}, 0)
        opts = pl.engine_options(1)
        assert (opts["num_cpus"], opts["num_gpus"], opts["scheduling_strategy"].placement_group_bundle_index) == \
            (0.25, 0, 1) and "runtime_env" not in opts
        gpu = dataclasses.replace(pl, gpus_per_rank=1, all_gpus_visible=True).trainer_options(0)
        assert gpu["num_gpus"] == 0.5 and gpu["runtime_env"] == \
            {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
        with pytest.raises(RefitError, match="engine rank 2 is outside 0..1"):
            pl.engine_options(2)
        with pytest.raises(RefitError, match=r"1 bundles \{'GPU': 1, 'CPU': 1\} was not placed within 2 s"):
            refit_ray.rl_placement(1, 1, colocated=False, timeout=2)  # a CPU-only cluster
        for v in (1, 2):
            job.refit_ok(v)
        ray_job.refit_ok(ray_job.version + 1)  # the other job's plan is untouched
    finally:
        pl.remove()
