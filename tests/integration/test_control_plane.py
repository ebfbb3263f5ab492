"""The gRPC control plane end to end, on loopback: a coordinator, trainer and engine agents in real
processes (spawn) moving a tiny Qwen3-MoE megatron:tp2ep2 -> vllm:tp2 over the CPU gloo transport,
bit-exact, with every failure the control plane must survive.

The tests of the shared cluster run in file order (versions only go up)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from refit.control.agent import EngineAgent, TrainerAgent
from refit.control.client import Client, RefitFailed
from refit.control.common import PROCESS_KEY_HEADER, process_key
from refit.control.dataplane import BaseDataPlane, NoopDataPlane
from refit.control.server import ThreadedServer
from refit.control.v1 import refit_pb2 as pb
from refit.errors import InvalidInput
from refit.control.v1 import refit_pb2_grpc as pb_grpc
from refit.sides import Side
from tests.harness.control_cluster import DST, MODEL, SRC, Worker
from tests.harness.loopback import close_all
from tests.harness.tiny import tiny_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Cluster:
    def __init__(self) -> None:
        self.server = ThreadedServer(default_timeout=20.0)
        self.address = self.server.address
        self.workers = {w.worker_id: w for w in
                        [Worker(self.address, "trainer", "trainer", r, SRC) for r in range(2)]
                        + [Worker(self.address, "engine", "engine", r, DST) for r in range(2)]}
        for w in self.workers.values():
            w.ready()
        self.client = Client(self.address)
        self.plan_id = self.client.create_plan("trainer", "engine", bucket_bytes=4096)["plan_id"]
        self.version = 0  # last version committed

    def trainers(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == "trainer"]

    def engines(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == "engine"]

    def fill(self, version: int) -> None:
        for w in self.trainers():
            w.ask("fill", version)

    def check_engines(self, version: int) -> None:
        for w in self.engines():
            assert w.ask("check", version) == [], f"{w.worker_id} does not hold version {version} bit-exactly"
            # it hears the commit just after the refit returns
            assert _settle(lambda w=w: w.ask("state") == (version, False, True)), (w.worker_id, w.ask("state"))
        rows = {r["worker_id"]: r for r in self.client.list_workers(role="engine") if r["info"]["group"] == "engine"}
        assert {k: (r["version"], r["stale"]) for k, r in rows.items()} == {w: (version, False) for w in rows}

    def refit_ok(self, version: int, timeout: float = 20.0) -> None:
        self.fill(version)
        result = self.client.refit(self.plan_id, version=version, timeout=timeout)
        assert result.ok and result.total_bytes == 150400, result
        self.version = version
        self.check_engines(version)

    def engines_stale(self) -> None:
        rows = [r for r in self.client.list_workers(group="engine")]
        assert all(r["stale"] for r in rows), rows
        for w in self.engines():
            version, stale, _ = w.ask("state")
            assert stale and version == self.version

    def close(self) -> None:
        close_all(self.workers.values(), self.client, self.server)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    yield c
    c.close()


def code_of(fn, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn(*args, **kwargs)
    return e.value.code()


def noop_agent(cls, address: str, group: str, rank: int, layout: str, model: str = MODEL, **kw):
    return cls(address, group=group, rank=rank, spec=tiny_spec(model), layout=layout, data_plane=NoopDataPlane(), **kw)


# ------------------------------------------------------------------------------------------------


def test_repeated_refits_bit_exact_with_events(cluster: Cluster) -> None:
    again = cluster.client.create_plan("trainer", "engine", bucket_bytes=4096)
    assert again["plan_id"] == cluster.plan_id and again["cached"] and again["num_buckets"] > 1
    full = cluster.client.get_plan(cluster.plan_id, include_plan=True)
    assert full["plan"].plan_hash == full["plan_hash"] and full["src_layout"] == "megatron:tp2ep2etp1dp1"
    events: list[dict] = []
    coord = cluster.server.server.coord
    assert not cluster.server.call(lambda: bool(coord.events))  # no watcher yet: the wait below means something
    stream = cluster.client.watch(cluster.plan_id)

    def watch() -> None:
        for e in stream:
            events.append(e)
            if e["kind"] == "KIND_FINISHED" and e["version"] == 3:
                return

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    # the watch is registered (the coordinator has a watcher) before the first refit starts
    assert _settle(lambda: cluster.server.call(lambda: bool(coord.events))), "the watch never registered"
    for v in (1, 2, 3):
        cluster.refit_ok(v)
    t.join(10)
    kinds = [e["kind"] for e in events if e["version"] == 3]
    assert kinds == ["KIND_STARTED"] + ["KIND_WORKER_DONE"] * 4 + ["KIND_FINISHED"]
    assert events[-1]["result"]["status"] == "REFIT_STATUS_OK"
    assert cluster.client.get_plan(cluster.plan_id)["version"] == 3


def test_broadcast_plan_bit_exact(cluster: Cluster) -> None:
    """The baseline planner runs under the control plane too (its stage 0 gathers full tensors on
    a trainer root, stage 1 sends them on): same bits in the engines."""
    plan = cluster.client.create_plan("trainer", "engine", planner="broadcast", bucket_bytes=8192)
    assert plan["plan_id"] != cluster.plan_id
    version = cluster.version + 1
    cluster.fill(version)
    result = cluster.client.refit(plan["plan_id"], version=version, timeout=20.0)
    assert result.ok, result
    cluster.version = version
    cluster.check_engines(version)
    cluster.refit_ok(version + 1)  # and back to the p2p plan


def test_version_must_increase(cluster: Cluster) -> None:
    """Lower versions are refused; the version committed last (still held) is answered again, as is."""
    assert code_of(cluster.client.refit, cluster.plan_id, version=cluster.version - 1) == \
        grpc.StatusCode.FAILED_PRECONDITION
    again = cluster.client.refit(cluster.plan_id, version=cluster.version)
    assert again.ok and again.version == cluster.version and again.total_bytes == 150400
    assert cluster.client.refit(cluster.plan_id, version=cluster.version).refit_id == again.refit_id
    # The broadcast plan committed version - 1, which its engines no longer hold: refused.
    other = cluster.client.create_plan("trainer", "engine", planner="broadcast", bucket_bytes=8192)["plan_id"]
    assert code_of(cluster.client.refit, other, version=cluster.version - 1) == grpc.StatusCode.FAILED_PRECONDITION
    for v in (2**53, 2**64 - 1):  # beyond what a version can mean: INVALID_ARGUMENT, nothing bricked
        assert code_of(cluster.client.refit, cluster.plan_id, version=v) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(cluster.client.refit, cluster.plan_id, version=cluster.version + 2**32 + 1) == \
        grpc.StatusCode.INVALID_ARGUMENT
    cluster.check_engines(cluster.version)


def test_unknown_plan(cluster: Cluster) -> None:
    c = cluster.client
    assert code_of(c.refit, "0123456789abcdef", version=99) == grpc.StatusCode.NOT_FOUND
    assert code_of(c.get_plan, "0123456789abcdef") == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: next(c.watch("0123456789abcdef"))) == grpc.StatusCode.NOT_FOUND


def test_deadline_overrun_fails_in_time_then_recovers(cluster: Cluster) -> None:
    v = cluster.version + 1
    slow = cluster.workers["engine/1"]
    slow.ask("delay", (v, 2.5))
    cluster.fill(v)
    t0 = time.monotonic()
    result = cluster.client.refit(cluster.plan_id, version=v, timeout=1.0, check=False)
    elapsed = time.monotonic() - t0
    # at its own timeout: before engine/1's share ends (2.5 s), which timed_out proves
    assert not result.ok and elapsed < 2.5, (elapsed, result)
    assert result.workers["engine/1"].outcome == "timed_out"
    assert result.error.split(": ", 1)[1].startswith("engine/1 timed out"), result.error
    cluster.engines_stale()
    # engine/1 is still asleep in its share: the next refit waits for it, then succeeds.
    cluster.refit_ok(v + 1)


def test_worker_killed_mid_refit(cluster: Cluster) -> None:
    v = cluster.version + 1
    victim = cluster.workers["trainer/1"]
    # trainer/1 kills itself (SIGKILL from its phase hook, no sleep) once every member finished
    # writing the plan (unphased: the whole of it), before it answers: every byte of v is in the
    # engines, and the coordinator must not commit it.
    victim.ask("fault", (v, "kill"))
    cluster.fill(v)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=cluster.client.refit(cluster.plan_id, version=v, timeout=8.0,
                                                                          check=False)))
    t0 = time.monotonic()
    t.start()
    assert victim.entered.wait(10)
    victim.proc.join(10)
    assert victim.proc.exitcode == -signal.SIGKILL, victim.proc.exitcode  # it died there, by its own hand
    t.join(10)
    result = out["r"]
    assert not result.ok and time.monotonic() - t0 < 8.0
    assert result.workers["trainer/1"].outcome == "disconnected"
    assert result.error.split(": ", 1)[1].startswith("trainer/1 disconnected"), result.error
    cluster.engines_stale()
    for w in cluster.engines():  # every byte of v landed, yet no engine is said to hold v
        assert w.ask("check", v) == [], w.worker_id
    # Without trainer/1 a refit fails at once, naming it.
    with pytest.raises(RefitFailed, match="trainer/1 not connected"):
        cluster.client.refit(cluster.plan_id, version=v, timeout=5.0)
    # The restarted worker re-registers under the same group/rank and the plan works again.
    old = {r["worker_id"]: r["session"] for r in cluster.client.list_workers(group="trainer")}
    cluster.workers["trainer/1"] = Worker(cluster.address, "trainer", "trainer", 1, SRC, version=0)
    cluster.workers["trainer/1"].ready()
    new = {r["worker_id"]: r for r in cluster.client.list_workers(group="trainer")}
    assert len(new) == 2 and new["trainer/1"]["connected"] and new["trainer/1"]["session"] != old["trainer/1"]
    cluster.refit_ok(v)  # a failed version may be retried


def test_disconnect_mid_refit_then_reconnect(cluster: Cluster) -> None:
    v = cluster.version + 1
    leaver = cluster.workers["trainer/0"]
    leaver.ask("delay", (v, 2.0))
    cluster.fill(v)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=cluster.client.refit(cluster.plan_id, version=v, timeout=8.0,
                                                                          check=False)))
    t.start()
    assert leaver.entered.wait(10)
    leaver.ask("disconnect")
    t.join(10)
    assert not out["r"].ok and out["r"].workers["trainer/0"].outcome == "disconnected", out["r"]
    cluster.engines_stale()
    leaver.ask("reconnect")
    cluster.refit_ok(v + 1)


def test_plan_refusals(cluster: Cluster) -> None:
    a = cluster.address
    agents = [noop_agent(EngineAgent, a, "qwen2", 0, "vllm:tp1", model="tiny-qwen2").start(),
              noop_agent(EngineAgent, a, "half", 0, "vllm:tp2").start()]
    c = cluster.client

    def refused(match: str, *args, **kwargs) -> None:
        with pytest.raises(grpc.RpcError) as e:
            c.create_plan(*args, **kwargs)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details(), e.value.details()

    try:
        refused("different models", "trainer", "qwen2")
        refused("rank 1 of vllm:tp2 is not registered", "trainer", "half")
        refused("no worker is registered in group 'nope'", "trainer", "nope")
        refused("a plan's source must be a trainer group", "engine", "trainer")
        refused("unknown planner", "trainer", "engine", planner="magic")
        refused("bucket size", "trainer", "engine", bucket_bytes=100)
        refused("unknown placement", "trainer", "engine", placement="sideways")
    finally:
        for ag in agents:
            ag.stop()


def test_malformed_requests_get_invalid_argument(cluster: Cluster) -> None:
    c = cluster.client
    ch = grpc.insecure_channel(cluster.address)
    stub = pb_grpc.CoordinatorStub(ch)
    bad = grpc.StatusCode.INVALID_ARGUMENT
    # Garbage bytes, for every method.
    for method in ("CreatePlan", "GetPlan", "ListWorkers", "Refit"):
        assert code_of(ch.unary_unary(f"/refit.v1.Coordinator/{method}"), b"\xff\xff\xff", timeout=5) == bad, method
    assert code_of(lambda: next(ch.unary_stream("/refit.v1.Coordinator/WatchRefits")(b"\xff\xff", timeout=5))) == bad
    assert code_of(lambda: list(ch.stream_stream("/refit.v1.Coordinator/Connect")(iter([b"\xff\xff"]), timeout=5))) == bad
    # Well-formed bytes, meaningless fields.
    assert code_of(stub.CreatePlan, pb.CreatePlanRequest(), timeout=5) == bad
    assert code_of(stub.GetPlan, pb.GetPlanRequest(), timeout=5) == bad
    assert code_of(stub.ListWorkers, pb.ListWorkersRequest(role=7), timeout=5) == bad
    assert code_of(stub.Refit, pb.RefitRequest(), timeout=5) == bad
    assert code_of(stub.Refit, pb.RefitRequest(plan_id=cluster.plan_id), timeout=5) == bad  # version 0
    assert code_of(stub.Refit, pb.RefitRequest(plan_id=cluster.plan_id, version=10**6, timeout_seconds=-1),
                   timeout=5) == bad
    assert code_of(stub.Refit, pb.RefitRequest(plan_id=cluster.plan_id, version=10**6, timeout_seconds=float("nan")),
                   timeout=5) == bad
    # A timeout beyond what members' timers hold (no call deadline to cap it): refused, nothing touched.
    assert code_of(stub.Refit, pb.RefitRequest(plan_id=cluster.plan_id, version=cluster.version + 1,
                                               timeout_seconds=1e15)) == bad
    assert not any(r["stale"] for r in c.list_workers(group="engine"))

    def connect(*msgs: pb.WorkerMessage) -> grpc.StatusCode:
        return code_of(lambda: list(stub.Connect(iter(msgs), timeout=5)))

    spec = tiny_spec(MODEL)
    good = noop_agent(EngineAgent, cluster.address, "x", 0, "vllm:tp2")._info()
    reg = lambda **kw: pb.WorkerMessage(register=pb.Register(info=pb.WorkerInfo(**{**_fields(good), **kw})))  # noqa
    assert connect(pb.WorkerMessage(result=pb.RunResult(refit_id="r"))) == bad  # no register first
    assert connect(reg(role=0)) == bad
    assert connect(reg(group="")) == bad
    assert connect(reg(rank=2)) == bad
    assert connect(reg(layout="vllm:tp3")) == bad
    assert connect(reg(model_digest="beef")) == bad
    assert connect(reg(model_config_json="{nope")) == bad
    assert connect(reg(role=pb.ROLE_TRAINER, layout="megatron:tp2ep2", group="engine")) == bad  # an engine group
    assert connect(reg(), pb.WorkerMessage(register=pb.Register())) == bad  # a second register
    assert spec.digest() == good.model_digest
    # Adversarial registrations: refused at once, with short messages, and nothing is built.
    cfg = json.loads(good.model_config_json)
    for kw in (dict(group="g" * 2**20), dict(layout="megatron:tp1dp4294967295"),
               dict(model_config_json=json.dumps({**cfg, "num_layers": 30_000_000})), dict(version=2**64 - 1)):
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Connect(iter([reg(**kw)]), timeout=5))
        assert e.value.code() == bad and len(e.value.details()) < 300 and time.monotonic() - t0 < 2, kw
    huge = reg(model_config_json="x" * (5 * 2**20))  # above the server's message cap: not read in full
    assert connect(huge) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A live worker's slot is not taken over by another process, even one claiming its host and pid
    # (ListWorkers shows them): engine/0 keeps its stream.
    live = c.list_workers(group="engine")[0]
    assert connect(reg(group="engine", rank=0)) == grpc.StatusCode.ALREADY_EXISTS
    assert connect(reg(group="engine", rank=0, host=live["info"]["host"], pid=live["info"]["pid"])) == \
        grpc.StatusCode.ALREADY_EXISTS
    assert all(r["connected"] for r in c.list_workers(group="engine"))
    ch.close()
    # Nothing of that broke the coordinator.
    cluster.refit_ok(cluster.version + 1)


def _fields(info: pb.WorkerInfo) -> dict:
    return {f.name: v for f, v in info.ListFields()}


def test_a_replaced_agent_comes_back(cluster: Cluster) -> None:
    """An agent whose slot was taken over by a registration that is not another agent of its process
    (here: a bare stream with this process's key) tries to come back, and is registered again once
    that stream ends, instead of staying out until its process restarts."""
    agent = noop_agent(EngineAgent, cluster.address, "back", 0, "vllm:tp1").start()
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(cluster.address))
    md = ((PROCESS_KEY_HEADER, process_key()),)
    stream = stub.Connect(iter([pb.WorkerMessage(register=pb.Register(info=agent._info()))]), metadata=md)
    try:
        assert next(stream).WhichOneof("kind") == "registered"
        assert _settle(lambda: agent.registrations >= 2 and agent.connected), agent.error
        assert not agent.wait_closed(0)
        rows = cluster.client.list_workers(group="back")
        assert [(r["session"], r["connected"]) for r in rows] == [(agent.session, True)]
    finally:
        stream.cancel()
        agent.stop()


def test_reregistration_replaces_old_stream(cluster: Cluster) -> None:
    a, c = cluster.address, cluster.client
    first = noop_agent(TrainerAgent, a, "rr", 0, "megatron:tp1").start()
    second = noop_agent(TrainerAgent, a, "rr", 0, "megatron:tp1").start()
    assert first.wait_closed(5) and "ABORTED" in str(first.error)
    rows = c.list_workers(group="rr")
    assert [(r["worker_id"], r["session"], r["connected"]) for r in rows] == [("rr/0", second.session, True)]
    engine = noop_agent(EngineAgent, a, "rr-engine", 0, "vllm:tp1").start()
    plan = c.create_plan("rr", "rr-engine")["plan_id"]
    assert c.refit(plan, version=1).ok
    assert _settle(lambda: (engine.version, engine.stale) == (1, False))
    # An engine back with another layout no longer fits the plan made for the old one.
    other = noop_agent(EngineAgent, a, "rr-engine", 0, "vllm:tp2").start()
    assert code_of(c.refit, plan, version=2) == grpc.StatusCode.FAILED_PRECONDITION
    for ag in (second, engine, other):
        ag.stop()


class GatedDataPlane(BaseDataPlane):
    """Moves nothing, on the agent's thread, and holds its share until ``release`` is set (a refit
    that runs until the test lets it end); records the refits it ran and sets ``entered``."""

    def __init__(self, release: threading.Event) -> None:
        self.release, self.entered, self.runs = release, threading.Event(), []

    def run(self, plan, tensors, ctx):  # type: ignore[no-untyped-def]
        self.runs.append(ctx.refit_id)
        self.entered.set()
        if not self.release.wait(ctx.remaining()):
            raise TimeoutError("never released")
        return 0, 0.0


def test_a_cancelled_refit_call_leaves_the_refit_to_its_joiners(cluster: Cluster) -> None:
    """The RL loop's first Refit call goes away (cancelled: its process died) while a second
    caller of the same version joined it: the joiner gets the refit's result, not CANCELLED, and
    the engine hears the commit."""
    import asyncio

    a, c = cluster.address, cluster.client
    spec = tiny_spec(MODEL)
    release = threading.Event()
    planes = [GatedDataPlane(release), GatedDataPlane(release)]
    agents = [TrainerAgent(a, group="gone-t", rank=0, spec=spec, layout="megatron:tp1", data_plane=planes[0]),
              EngineAgent(a, group="gone-e", rank=0, spec=spec, layout="vllm:tp1", data_plane=planes[1])]
    for ag in agents:
        ag.start()
    # The coordinator's Refit calls, as they arrive and as they are cancelled (the servicer's
    # task is cancelled with its RPC): what "the joiner joined" and "the first call went away" mean.
    coord = cluster.server.server.coord
    calls: list[int] = []
    cancelled = threading.Event()

    async def watched(plan_id: str, version: int, timeout: float, **kw: bool):
        calls.append(version)
        try:
            return await type(coord).refit(coord, plan_id, version, timeout, **kw)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    coord.refit = watched
    ch = grpc.insecure_channel(a)
    try:
        plan = c.create_plan("gone-t", "gone-e")["plan_id"]
        first = pb_grpc.CoordinatorStub(ch).Refit.future(pb.RefitRequest(plan_id=plan, version=1, timeout_seconds=10),
                                                         timeout=20)
        assert all(p.entered.wait(10) for p in planes), "the refit never started"  # under way, held by the planes
        out: dict = {}

        def join() -> None:
            try:
                out["r"] = c.refit(plan, version=1, timeout=10, check=False)
            except grpc.RpcError as e:
                out["r"] = e

        joiner = threading.Thread(target=join)
        joiner.start()
        # the joiner's call reached the coordinator (it joins in the same loop step, before the
        # cancellation below can be processed)
        assert _settle(lambda: len(calls) == 2), calls
        first.cancel()
        assert cancelled.wait(10), "the coordinator never saw the first call cancelled"
        assert not out and len(planes[0].runs) == 1 and planes[1].runs == planes[0].runs  # one refit, still held
        release.set()
        joiner.join(15)
        assert "r" in out, "the joiner got no answer"
        assert not isinstance(out["r"], grpc.RpcError), out["r"]
        assert out["r"].ok, out["r"].error
        assert out["r"].refit_id == planes[0].runs[0] and [len(p.runs) for p in planes] == [1, 1]  # joined, not rerun
        assert _settle(lambda: (agents[1].version, agents[1].stale) == (1, False))
    finally:
        del coord.refit  # back to the class's
        release.set()
        ch.close()
        for ag in agents:
            ag.stop()


def test_stop_closes_the_data_plane(cluster: Cluster) -> None:
    """An agent that stops lets its data plane go (gloo groups and store connection here; on GPUs
    also NCCL communicators and maps of the trainers' memory): vLLM's `init_transfer_engine`
    called again, or an attach repeated, stops the old agent and kept all of that alive."""
    import torch

    from refit.control.dataplane_executor import ExecutorDataPlane
    from refit.layouts import resolve_layout
    from tests.harness.control_cluster import fill

    a, c, spec = cluster.address, cluster.client, tiny_spec(MODEL)
    src, dst = resolve_layout("megatron:tp1", spec, Side.TRAINER), resolve_layout("vllm:tp1", spec, Side.ENGINE)
    planes = [ExecutorDataPlane(), ExecutorDataPlane()]
    got = {lt.name: torch.zeros(lt.shape, dtype=torch.bfloat16) for lt in dst.local_tensors(spec, 0)}
    agents = [TrainerAgent(a, group="stop-t", rank=0, spec=spec, layout=src, tensors=fill(spec, src, 0, 1),
                           data_plane=planes[0]).start(),
              EngineAgent(a, group="stop-e", rank=0, spec=spec, layout=dst, tensors=got, data_plane=planes[1]).start()]
    try:
        assert c.refit(c.create_plan("stop-t", "stop-e")["plan_id"], version=1).ok
        want = fill(spec, dst, 0, 1)
        assert [n for n in want if not torch.equal(want[n].view(torch.int16), got[n].view(torch.int16))] == []
        members = [h.member for dp in planes for h in dp._members.values()]
        assert len(members) == 2 and all(m.ctl is not None for m in members)
    finally:
        for ag in agents:
            ag.stop()
    assert all(m.ctl is None for m in members) and not any(dp._members for dp in planes)


def _settle(cond, timeout: float = 5.0) -> bool:
    """The engine hears the commit just after the refit returns."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_token_required_everywhere() -> None:
    srv = ThreadedServer(token="s3cret")
    try:
        for token in (None, "wrong"):
            c = Client(srv.address, token=token)
            assert code_of(c.list_workers) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(c.health) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda: next(c.watch())) == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(ConnectionError, match="UNAUTHENTICATED"):
                noop_agent(TrainerAgent, srv.address, "t", 0, "megatron:tp1", token=token).start(timeout=5)
            c.close()
        c = Client(srv.address, token="s3cret")
        agent = noop_agent(TrainerAgent, srv.address, "t", 0, "megatron:tp1", token="s3cret").start()
        assert c.health() == "SERVING" and [r["worker_id"] for r in c.list_workers()] == ["t/0"]
        agent.stop()
        c.close()
    finally:
        srv.stop()


def test_serve_main_binds_loopback() -> None:
    code = "import sys; from refit.control.server import serve_main; sys.exit(serve_main(['--port', '0']))"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    try:
        line = proc.stderr.readline()
        assert "listening on 127.0.0.1:" in line, line
        with Client(line.strip().rsplit(" ", 1)[1]) as c:
            assert c.health() == "SERVING" and c.health("refit.v1.Coordinator") == "SERVING"
    finally:
        proc.terminate()
        proc.wait(10)


def test_serve_main_stops_cleanly_on_sigterm_failing_the_refit_under_way() -> None:
    """SIGTERM: `refit serve` exits 0 with no traceback (it exited 1 with a CancelledError every
    time: supervisors read that as a crash), and the refit under way fails naming the stop."""
    code = "import sys; from refit.control.server import serve_main; sys.exit(serve_main(['--port', '0']))"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    release = threading.Event()
    agents: list = []
    try:
        address = proc.stderr.readline().strip().rsplit(" ", 1)[1]
        spec = tiny_spec(MODEL)
        plane = GatedDataPlane(release)
        agents += [TrainerAgent(address, group="t", rank=0, spec=spec, layout="megatron:tp1", data_plane=plane,
                                reconnect=False).start(),
                   noop_agent(EngineAgent, address, "e", 0, "vllm:tp1", reconnect=False).start()]
        with Client(address) as c:
            plan = c.create_plan("t", "e")["plan_id"]
            answer: list = []
            caller = threading.Thread(target=lambda: answer.append(c.refit(plan, version=1, timeout=30, check=False)))
            caller.start()
            assert plane.entered.wait(10)
            proc.send_signal(signal.SIGTERM)
            caller.join(15)
        assert proc.wait(15) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err, err
        assert answer and not answer[0].ok and "the coordinator stopped before it ended" in answer[0].error, answer
    finally:
        release.set()
        for ag in agents:
            ag.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_main_refuses_a_taken_port_and_reads_the_token_file(tmp_path) -> None:
    srv = ThreadedServer(token="from-file")
    try:
        port = srv.address.rsplit(":", 1)[1]
        code = f"import sys; from refit.control.server import serve_main; sys.exit(serve_main(['--port', '{port}']))"
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": ROOT})
        assert proc.returncode == 2 and "address in use" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        from refit.control.server import build_parser, read_token

        f = tmp_path / "token"
        f.write_text("from-file\n")
        assert read_token(build_parser().parse_args(["--token-file", str(f)])) == "from-file"
        for bad in ("caf\u00e9", "two\nlines", "a b"):  # no client can send these in its header
            f.write_text(bad)
            with pytest.raises(InvalidInput, match="the token holds a character no client can send"):
                read_token(build_parser().parse_args(["--token-file", str(f)]))
            with pytest.raises(InvalidInput, match="--token: the token holds a character"):
                read_token(build_parser().parse_args(["--token", bad]))
        # An empty token starts an open coordinator: said loudly.
        open_code = ("import sys; from refit.control.server import serve_main; "
                     "sys.exit(serve_main(['--port', '0', '--token', '']))")
        env = {k: v for k, v in os.environ.items() if k != "REFIT_TOKEN"}
        proc = subprocess.Popen([sys.executable, "-c", open_code], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                env={**env, "PYTHONPATH": ROOT})
        try:
            head = proc.stderr.readline() + proc.stderr.readline()
            assert "requires NO token" in head and "listening on" in head, head
        finally:
            proc.terminate()
            proc.wait(10)
        with Client(srv.address, token="from-file") as c:
            assert c.health() == "SERVING"
    finally:
        srv.stop()


def test_store_add_beyond_int64_is_refused_and_stores_nothing() -> None:
    """A StoreAdd whose sum leaves int64 (the answer's type) is INVALID_ARGUMENT naming the key,
    and the key keeps its value (it was INTERNAL, with the out-of-range sum stored)."""
    srv = ThreadedServer()
    try:
        srv.call(lambda: srv.server.coord.store.open("p/"))
        stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(srv.address))
        add = lambda amount: stub.StoreAdd(pb.StoreAddRequest(prefix="p/", key="n", amount=amount), timeout=5)  # noqa
        assert add(2**63 - 1).value == 2**63 - 1
        for amount in (1, 2**63 - 1):
            with pytest.raises(grpc.RpcError) as e:
                add(amount)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "key 'n'" in e.value.details() \
                and "beyond a signed 64-bit integer" in e.value.details(), e.value.details()
        assert add(-(2**63 - 1)).value == 0  # unchanged by the refusals
    finally:
        srv.stop()


def test_stop_ends_rendezvous_waits() -> None:
    """A stopped coordinator ends the rendezvous waits under way (a member blocked on a peer's key
    is told at once, not at its deadline), and its port closes."""
    import socket

    from refit.control.dataplane import Cancelled
    from refit.control.store_client import CoordinatorStore

    srv = ThreadedServer()
    srv.call(lambda: srv.server.coord.store.open("p/"))
    store = CoordinatorStore(srv.address, "p/", None, 60.0)
    store.set("here", b"1")
    assert store.get("here") == b"1" and store.check(["here"]) and not store.check(["absent"])
    box: dict[str, BaseException] = {}
    waiting = threading.Thread(target=lambda: box.setdefault("e", _raised(lambda: store.get("never"))))
    waiting.start()
    _settle(lambda: srv.call(lambda: srv.server.coord.store.spaces["p/"]._changed is not None))
    t0 = time.monotonic()
    srv.stop()
    waiting.join(10)
    assert isinstance(box.get("e"), (Cancelled, ConnectionError)) and time.monotonic() - t0 < 5
    port = int(srv.address.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    store.close()


def _raised(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the test inspects it
        return e
    return None


def test_serve_refuses_a_default_timeout_that_is_not_positive(capsys) -> None:
    """`refit serve --timeout 0` (or negative, or nan) would fail every refit that gives no
    timeout of its own, at once and blaming the request: refused at start instead."""
    from refit.control.server import CoordinatorServer, serve_main
    from refit.errors import RefitError

    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(RefitError, match="--timeout must be a number of seconds in"):
            CoordinatorServer(port=0, default_timeout=bad)
    assert serve_main(["--port", "0", "--timeout", "0"]) == 2
    assert "--timeout must be a number of seconds in (0, 604800], got 0.0" in capsys.readouterr().err


def test_client_raises_refit_exceptions() -> None:
    from refit.control.client import ControlError, Unavailable

    with Client("127.0.0.1:1", timeout=2.0) as c:
        with pytest.raises(Unavailable) as e:
            c.list_workers()
    assert isinstance(e.value, ControlError) and e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_refit_timeout_zero_leaves_the_deadline_to_the_coordinator() -> None:
    """``refit(timeout=0)`` asks for the coordinator's default timeout: the call itself then has no
    deadline of ours (it had 10 s, which cut a longer default short).  A stand-in stub records the
    call; a bad role is refused before any call."""
    from types import SimpleNamespace

    from refit.errors import RefitError

    calls: list[tuple[float, float | None]] = []

    def refit(req: pb.RefitRequest, metadata: object, timeout: float | None) -> pb.RefitResponse:
        calls.append((req.timeout_seconds, timeout))
        return pb.RefitResponse(status=pb.REFIT_STATUS_OK)

    with Client("127.0.0.1:1") as c:
        c._stub = SimpleNamespace(Refit=refit)
        c.refit("plan", 1, timeout=0)
        c.refit("plan", 2, timeout=5)
        with pytest.raises(RefitError, match="role must be one of trainer, engine"):
            c.list_workers(role="engines")
    assert calls == [(0.0, None), (5.0, 15.0)]


def test_generated_stubs_are_fresh(tmp_path) -> None:
    pytest.importorskip("grpc_tools")
    sys.path.insert(0, os.path.join(ROOT, "proto"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    if generate.tools_version() != generate.TOOLS_VERSION:  # other tools: compare what the .proto says
        generate.generate(str(tmp_path), any_tools=True)
        fresh = generate.descriptor_blob(os.path.join(tmp_path, "refit_pb2.py"))
        assert fresh == generate.descriptor_blob(os.path.join(generate.PACKAGE_DIR, "refit_pb2.py")), \
            "refit/control/v1 is stale: run proto/generate.py under grpcio-tools " + generate.TOOLS_VERSION
        return
    for path in generate.generate(str(tmp_path)):
        name = os.path.basename(path)
        with open(path, "rb") as f, open(os.path.join(generate.PACKAGE_DIR, name), "rb") as g:
            assert f.read() == g.read(), f"refit/control/v1/{name} is stale: run python proto/generate.py"
