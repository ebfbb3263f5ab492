"""Fault injection on the control plane: idle agents, coordinator restarts, a second coordinator on
a taken port, concurrent callers, SIGKILL / SIGSTOP of members at the start and mid-transfer.

Each trial is bounded (a hard per-test timeout through `bounded`) and asserts what a user must be
able to rely on: the right worker is named within the deadline, torn weights are never reported
fresh, and the next refit recovers.  Agents in this process use the no-op data plane where only
the control plane is under test; the kill/stop trials run real agent processes moving real
weights over gloo (tests/harness/control_cluster.py) and check them bit for bit.  Their engines
stage by phases, so that a "mid" fault strikes inside the refit, deterministically: the victim
signals itself once the plan's first phase has landed on every member (`AfterFirstPhase`), and
the surviving engines must hold exactly that phase of the new version and the rest of the old."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import signal
import socket
import threading
import time
from typing import Any, Callable

import pytest

from refit.cli import main as cli_main
from refit.control.agent import EngineAgent, TrainerAgent
from refit.control.client import Client, InvalidRequest, VersionRefused
from refit.control.dataplane import NoopDataPlane
from refit.control.dataplane_executor import ExecutorDataPlane
from refit.control.server import ThreadedServer
from refit.errors import RefitError
from refit.sides import Side
from tests.harness.control_cluster import DST, MODEL, SRC, Worker
from tests.harness.loopback import close_all
from tests.harness.tiny import tiny_spec

FAST = dict(keepalive_ms=200, keepalive_timeout_ms=1000)  # pings 5x a second: idle faults show in seconds


def bounded(seconds: float) -> Callable:
    """Fail (instead of hanging the suite) when a trial runs past ``seconds``."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> None:
            box: dict[str, BaseException] = {}

            def target() -> None:
                try:
                    fn(*args, **kwargs)
                except BaseException as e:  # re-raised in the test's thread
                    box["e"] = e

            t = threading.Thread(target=target, daemon=True)
            t.start()
            t.join(seconds)
            assert not t.is_alive(), f"{fn.__name__} ran past its bound of {seconds} s"
            if "e" in box:
                raise box["e"]
        return run
    return wrap


class Counting(NoopDataPlane):
    """The no-op data plane, counting the shares it ran (by version)."""

    inline = False

    def __init__(self, delay: float = 0.0) -> None:
        self.delay, self.calls = delay, []

    def run(self, plan, tensors, ctx):  # type: ignore[no-untyped-def]
        self.calls.append(ctx.version)
        time.sleep(self.delay)
        return 0, 0.0


def agents(address: str, dp: Callable[[], Any] = NoopDataPlane, **kw: Any) -> list:
    spec = tiny_spec("tiny-qwen2")
    out = [TrainerAgent(address, group="t", rank=0, spec=spec, layout="megatron:tp1", data_plane=dp(), **kw),
           EngineAgent(address, group="e", rank=0, spec=spec, layout="vllm:tp1", data_plane=dp(), **kw)]
    return [a.start() for a in out]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@bounded(30)
def test_idle_agents_stay_connected() -> None:
    """Many keepalive intervals of silence: no GOAWAY too_many_pings, no reconnect needed."""
    srv = ThreadedServer(**FAST)
    team = agents(srv.address, backoff=(0.05, 0.2), **FAST)
    try:
        time.sleep(4.0)  # 20 ping intervals; without the server's ping policy grpc drops us in ~1 s
        assert all(a.connected and a.registrations == 1 for a in team), [(a.connected, a.registrations) for a in team]
        with Client(srv.address) as c:
            plan = c.create_plan("t", "e")["plan_id"]
            assert c.refit(plan, 1).ok
    finally:
        for a in team:
            a.stop()
        srv.stop()


@bounded(60)
def test_agents_reconnect_after_a_coordinator_restart_mid_refit() -> None:
    port = free_port()
    srv = ThreadedServer(port=port, **FAST)
    planes: list[Counting] = []

    def plane() -> Counting:
        planes.append(Counting())
        return planes[-1]

    team = agents(f"127.0.0.1:{port}", plane, backoff=(0.05, 0.5), **FAST)
    try:
        with Client(srv.address) as c:
            plan = c.create_plan("t", "e")["plan_id"]
            first = c.refit(plan, 3)
            for p in planes:
                p.delay = 1.0
            cut: list = []  # what the caller of refit 4 got (a failure in a thread must reach the test)

            def call_4() -> None:
                try:
                    cut.append(c.refit(plan, 4))
                except Exception as e:  # noqa: BLE001 - the test reads it
                    cut.append(e)

            mid = threading.Thread(target=call_4, daemon=True)
            mid.start()
            assert _settle(lambda: all(p.calls[-1:] == [4] for p in planes))
        srv.stop()  # killed mid-refit: version 4 is never committed
        mid.join(10)
        assert len(cut) == 1 and isinstance(cut[0], Exception), cut  # failed, not committed
        for p in planes:
            p.delay = 0.0
        assert _settle(lambda: not any(a.connected for a in team))
        srv = ThreadedServer(port=port, **FAST)
        assert _settle(lambda: all(a.connected for a in team), 15), [a.error for a in team]
        assert [a.registrations for a in team] == [2, 2]
        with Client(srv.address) as c:
            rows = {r["worker_id"]: (r["version"], r["stale"]) for r in c.list_workers()}
            assert rows == {"t/0": (0, False), "e/0": (3, True)}  # the version it holds, torn by refit 4
            plan = c.create_plan("t", "e")["plan_id"]
            with pytest.raises(VersionRefused):
                c.refit(plan, 3)
            again = c.refit(plan, 4)  # the old refit's late results (other ids) are not counted
            assert again.ok and again.refit_id != first.refit_id
            assert _settle(lambda: (team[1].version, team[1].stale) == (4, False))
    finally:
        for a in team:
            a.stop()
        srv.stop()


@bounded(30)
def test_a_second_coordinator_on_a_taken_port_refuses_to_start() -> None:
    srv = ThreadedServer()
    try:
        port = int(srv.address.rsplit(":", 1)[1])
        with pytest.raises(RefitError, match="address in use"):
            ThreadedServer(port=port)
    finally:
        srv.stop()


@bounded(30)
def test_concurrent_callers_of_one_version_share_one_run() -> None:
    srv = ThreadedServer()
    planes: list[Counting] = []

    def plane() -> Counting:
        planes.append(Counting(delay=0.5))
        return planes[-1]

    team = agents(srv.address, plane)
    try:
        with Client(srv.address) as c:
            plan = c.create_plan("t", "e")["plan_id"]
            out: list = []
            callers = [threading.Thread(target=lambda: out.append(c.refit(plan, 1))) for _ in range(3)]
            for t in callers:
                t.start()
            for t in callers:
                t.join(10)
            assert len(out) == 3 and all(r.ok for r in out) and len({r.refit_id for r in out}) == 1
            assert [p.calls for p in planes] == [[1], [1]]  # one data-plane run per member
            # v2 and v3 at once: both run, in order, each once.  v3 is asked for once v2 runs (its
            # members hold it in their data planes), not after a sleep that may or may not suffice.
            out.clear()
            for p in planes:
                p.delay = 0.3
            callers = [threading.Thread(target=lambda v=v: out.append(c.refit(plan, v))) for v in (2, 3)]
            callers[0].start()
            assert _settle(lambda: all(p.calls[-1:] == [2] for p in planes))
            callers[1].start()
            for t in callers:
                t.join(10)
            for p in planes:
                p.delay = 0.0
            assert sorted(r.version for r in out) == [2, 3] and all(r.ok for r in out)
            assert [p.calls for p in planes] == [[1, 2, 3], [1, 2, 3]]
            assert _settle(lambda: (team[1].version, team[1].stale) == (3, False))
    finally:
        for a in team:
            a.stop()
        srv.stop()


def _settle(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


# ------------------------------------------------------------------------------------------------
# Real agent processes (gloo on CPU), killed or stopped at the start barrier or mid-transfer.

class ProcCluster:
    """Trainer and engine agent processes of one plan.  By default the engines register with
    phase_layers=1: the plan runs in phases (one per non-layer tensor, then one per layer), and a
    fault can strike between two of them."""

    def __init__(self, model: str = MODEL, src: str = SRC, dst: str = DST, engines: int = 2,
                 phase_layers: int = 1, **server: Any) -> None:
        self.server = ThreadedServer(default_timeout=20.0, **server)
        self.model, self.src, self.dst = model, src, dst
        self.workers = {w.worker_id: w for w in
                        [Worker(self.server.address, "trainer", "trainer", r, src, model=model) for r in range(2)]
                        + [Worker(self.server.address, "engine", "engine", r, dst, phase_layers=phase_layers,
                                  model=model) for r in range(engines)]}
        for w in self.workers.values():
            w.ready()
        self.client = Client(self.server.address)
        summary = self.client.create_plan("trainer", "engine", bucket_bytes=4096)
        self.plan = summary["plan_id"]
        assert (summary["num_phases"] > 1) == (phase_layers > 0), summary
        plan = self.plan_obj = self.client.get_plan(self.plan, include_plan=True)["plan"]
        self.plan_dict, self.first_phase = plan.to_dict(), plan.phase_ranges()[0][0]
        self.version = 0

    @property
    def engines(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == "engine"]

    def fill(self, v: int) -> None:
        for w in self.workers.values():
            if w.role == "trainer":
                w.ask("fill", v)

    def refit_ok(self, v: int, **kw: Any) -> Any:
        self.fill(v)
        result = self.client.refit(self.plan, v, timeout=20.0, **kw)
        assert result.ok
        self.version = v
        for w in self.workers.values():
            if w.role == "engine":  # it hears the commit just after the refit returns
                assert w.ask("check", v) == [] and _settle(lambda w=w: w.ask("state") == (v, False, True)), \
                    (w.worker_id, w.ask("state"))
        return result

    def replace(self, wid: str, version: int | None = None) -> None:
        """Kill ``wid`` and start another in its place; an engine holding ``version`` (default:
        the current one, as if loaded from the last checkpoint)."""
        old = self.workers[wid]
        old.kill()
        group, rank = wid.split("/")
        self.add(Worker(self.server.address, old.role, group, int(rank), self.src if old.role == "trainer" else self.dst,
                        version=(self.version if version is None else version) if old.role == "engine" else 0,
                        phase_layers=old.phase_layers, model=self.model))

    def add(self, worker: Worker) -> Worker:
        self.workers[worker.worker_id] = worker
        worker.ready()
        return worker

    def close(self) -> None:
        close_all(self.workers.values(), self.client, self.server)


@pytest.fixture(scope="module")
def procs():
    c = ProcCluster()
    c.refit_ok(1)
    yield c
    c.close()


TRIALS = [(sig, wid, when) for sig in ("kill", "stop") for wid in ("trainer/1", "engine/0") for when in ("start", "mid")]


@pytest.mark.parametrize("sig,wid,when", TRIALS, ids=["-".join(t) for t in TRIALS])
@bounded(60)
def test_member_killed_or_stopped_is_named_in_time(procs: ProcCluster, sig: str, wid: str, when: str) -> None:
    v = procs.version + 1
    victim = procs.workers[wid]
    for w in procs.workers.values():
        if w.role == "trainer":
            w.ask("fill", v)
    # "start": the victim stalls before its share (the others wait at the start barrier), and the
    # test strikes it there.  "mid": the victim strikes itself (SIGKILL / SIGSTOP, from its phase
    # hook) once the plan's first phase has landed on every member: part of version v is in the
    # engines, the next phase has not started.  No sleep decides where the fault lands.
    if when == "start":
        victim.ask("delay", (v, 30.0))
    else:
        victim.ask("fault", (v, sig))
    out: dict = {}
    timeout = 4.0
    t = threading.Thread(target=lambda: out.update(r=procs.client.refit(procs.plan, v, timeout=timeout, check=False)))
    t0 = time.monotonic()
    t.start()
    assert victim.entered.wait(10)
    if when == "start":
        os.kill(victim.proc.pid, signal.SIGKILL if sig == "kill" else signal.SIGSTOP)
    t.join(timeout + 5)
    r = out["r"]
    # named at the deadline, not after some longer wait (the margin is for a loaded 2-core machine)
    assert not r.ok and time.monotonic() - t0 < timeout + 2.0, r
    first = r.error.split(": ", 1)[1]
    want = "disconnected" if sig == "kill" else "timed out"
    assert first.startswith(f"{wid} {want}") or (when == "mid" and sig == "kill" and first.startswith(wid)), r.error
    for e in (w for w in procs.workers.values() if w.role == "engine" and w is not victim):
        version, stale, _ = e.ask("state")
        assert stale, "torn weights reported fresh"
        assert version == procs.version, (version, procs.version)
        if when == "mid":  # torn for real: exactly the first phase of v landed, the rest is v - 1
            assert e.ask("mixed", (procs.version, v, procs.plan_dict, procs.first_phase)) == [], e.worker_id
            assert e.ask("check", procs.version) and e.ask("check", v), f"{e.worker_id} holds no mix"
        else:  # nothing moved before the start barrier
            assert e.ask("check", procs.version) == [], e.worker_id
    if sig == "stop":
        os.kill(victim.proc.pid, signal.SIGCONT)
    procs.replace(wid)  # a restarted worker re-registers; the next refit recovers, bit-exact
    procs.refit_ok(v + 1)


@bounded(90)
def test_delta_refits_of_a_phased_plan_plain_and_atomic(procs: ProcCluster) -> None:
    """Delta refits of a phased MoE plan (each phase's buckets kept and encoded on their own),
    plain then atomic (the staging refreshed from the live weights first): every engine exact after
    each.  Going from plain to atomic refits and back moves the engines' tensors (live or staging),
    which builds the members again within the refit: that one goes in full and says why."""
    base = procs.version + 1
    procs.refit_ok(base, delta=True)
    for v, atomic, rebuilt in ((base + 1, False, False), (base + 2, True, True), (base + 3, True, False),
                               (base + 4, False, True), (base + 5, False, False)):
        step = (v, base, 0.03)
        procs.fill(step)
        r = procs.client.refit(procs.plan, v, timeout=20.0, delta=True, atomic=atomic)
        assert r.ok, r
        if rebuilt:
            assert "built again within the refit" in r.delta_fallback and r.delta["delta_buckets"] == 0, r
        else:
            assert r.delta_fallback == "" and r.delta["delta_buckets"] > 0, r
            assert r.delta["wire_bytes"] < r.delta["full_bytes"] / 2, r.delta
        for e in procs.engines:
            assert _settle(lambda e=e: e.ask("state") == (v, False, True)), e.worker_id
            assert e.ask("check", step) == [], (e.worker_id, atomic)
        procs.version = v


# ------------------------------------------------------------------------------------------------
# All or none across three engines, and verified refits (`Client.refit(atomic=..., verify=...)`)


DROP_AFTER = 3.0  # the fleet's coordinator: a replica gone this long is left out of refits


@pytest.fixture(scope="module")
def fleet():
    """Two Megatron tp2 trainers and three vLLM dp replicas (plain engine agents, not phased) of a
    dense model: engine/0..2."""
    c = ProcCluster(model="tiny-qwen2", src="megatron:tp2", dst="vllm:tp1dp3", engines=3, phase_layers=0,
                    drop_after=DROP_AFTER)
    c.refit_ok(1)
    yield c
    c.close()


def _holding(fleet: ProcCluster) -> dict[str, tuple[int, bool]]:
    return {w["worker_id"]: (w["version"], w["stale"]) for w in fleet.client.list_workers(role="engine")
            if w["connected"]}


FLEET_TRIALS = [(victim, atomic) for victim in ("engine/2", "trainer/1") for atomic in (True, False)]


@pytest.mark.parametrize("victim,atomic", FLEET_TRIALS,
                         ids=[f"{v}-{'atomic' if a else 'default'}" for v, a in FLEET_TRIALS])
@bounded(90)
def test_a_member_killed_after_the_engines_staged(fleet: ProcCluster, victim: str, atomic: bool) -> None:
    """The victim dies once every member ran its share (every engine holds version v, staged or
    written): atomic, no engine switches — each serves v - 1 whole and says so (not stale); by
    default the engines hold v's bytes and report themselves stale (the documented torn state).
    The refit fails naming the victim, and the next one, with a replacement, is exact."""
    old, v = fleet.version, fleet.version + 1
    fleet.fill(v)
    fleet.workers[victim].ask("after", (v, "kill"))
    t0 = time.monotonic()
    r = fleet.client.refit(fleet.plan, v, timeout=10.0, check=False, atomic=atomic)
    assert not r.ok and r.atomic == atomic and time.monotonic() - t0 < 12.0, r
    assert r.error.split(": ", 1)[1].startswith(f"{victim} disconnected"), r.error
    survivors = [e for e in fleet.engines if e.worker_id != victim]
    for e in survivors:
        if atomic:  # nothing live changed; it says it holds v - 1, whole
            assert _settle(lambda e=e: e.ask("state") == (old, False, True)), (e.worker_id, e.ask("state"))
            assert e.ask("check", old) == [], e.worker_id
        else:  # it holds v's bytes, reported stale at version v - 1
            assert e.ask("state")[:2] == (old, True) and e.ask("check", v) == [], e.worker_id
    held = _holding(fleet)
    assert all(held[e.worker_id] == (old, not atomic) for e in survivors), held
    fleet.replace(victim)
    fleet.refit_ok(v + 1, atomic=atomic)
    assert all(h == (v + 1, False) for h in _holding(fleet).values())


@bounded(90)
def test_verify_names_a_corrupted_transfer(fleet: ProcCluster) -> None:
    """One bit of one received tensor flipped after it landed (as a wire fault would): the
    verified refit fails naming the tensor, the box and both ranks; atomic, so no engine switched.
    A clean verified refit then counts every transfer as matched."""
    old, v = fleet.version, fleet.version + 1
    fleet.fill(v)
    fleet.workers["engine/1"].ask("after", (v, ("corrupt", "model.norm.weight")))
    r = fleet.client.refit(fleet.plan, v, timeout=10.0, check=False, atomic=True, verify=True)
    assert not r.ok, r
    assert "engine/1 error: verify: 1 transfer(s) differ: model.norm.weight[0:" in r.error, r.error
    assert " from trainer/" in r.error and " to engine/1: checksum " in r.error, r.error
    for e in fleet.engines:
        assert _settle(lambda e=e: e.ask("state") == (old, False, True)) and e.ask("check", old) == [], e.worker_id
    result = fleet.refit_ok(v + 1, atomic=True, verify=True)
    stage1 = sum(1 for t in fleet.plan_obj.transfers if t.stage == 1)
    assert result.verified_transfers == stage1 > 0, result


@bounded(90)
def test_delta_refits_send_what_changed_and_fall_back_in_full(fleet: ProcCluster) -> None:
    """`Client.refit(delta=True)` over gloo: the first delta refit goes in full (nothing kept yet,
    or a failed refit before it) and says so; after a small step the next sends only the changed words, verified, every engine
    exact; a plain refit in between, or a replica replaced, sends the next one in full again."""
    base = fleet.version + 1
    first = fleet.refit_ok(base, delta=True)
    assert first.delta_fallback.startswith(("no delta refit of this plan", "the last refit of this plan failed")), first
    assert first.delta["wire_bytes"] >= first.delta["full_bytes"] > 0, first.delta
    v = base + 1
    step = (v, base, 0.02)  # 2% of the bfloat16 values change
    fleet.fill(step)
    r = fleet.client.refit(fleet.plan, v, timeout=20.0, delta=True, verify=True)
    assert r.ok and r.delta_fallback == "" and r.verified_transfers > 0, r
    assert r.delta["delta_buckets"] == r.delta["buckets"] > 0, r.delta
    assert 0.005 < r.delta["changed_fraction"] < 0.05 and r.delta["wire_bytes"] < r.delta["full_bytes"] / 5, r.delta
    for e in fleet.engines:
        assert e.ask("check", step) == [], e.worker_id
    fleet.version = v
    fleet.refit_ok(v + 1)  # a plain refit: the trainers keep nothing
    r = fleet.refit_ok(v + 2, delta=True)
    assert "was not a delta refit" in r.delta_fallback, r.delta_fallback
    fleet.replace("engine/1")
    r = fleet.refit_ok(v + 3, delta=True)
    assert "built again" in r.delta_fallback, r.delta_fallback


@bounded(60)
def test_check_compares_what_the_engines_hold_without_moving_weights(fleet: ProcCluster) -> None:
    """`Client.check` (`refit verify --plan`): every transfer's two ends equal after a refit; one
    bit of one engine's weights flipped is named (tensor, box, both ranks); versions unchanged."""
    stage1 = sum(1 for t in fleet.plan_obj.transfers if t.stage == 1)
    held = _holding(fleet)
    r = fleet.client.check(fleet.plan)
    assert r.ok and r.verified_transfers == stage1 and r.version == fleet.version, r
    fleet.workers["engine/2"].ask("corrupt", "model.norm.weight")
    r = fleet.client.check(fleet.plan, check=False)
    assert not r.ok and "engine/2 error: verify: 1 transfer(s) differ: model.norm.weight[0:" in r.error, r.error
    assert _holding(fleet) == held  # a check changes no version or staleness
    assert refit_cli(["verify", "--plan", fleet.plan, "--coordinator", fleet.server.address, "--json"])[0] == 3
    fleet.refit_ok(fleet.version + 1)  # the next refit rewrites it
    status, out = refit_cli(["verify", "--plan", fleet.plan, "--coordinator", fleet.server.address, "--json"])
    assert status == 0 and json.loads(out) == {**json.loads(out), "ok": True, "verified_transfers": stage1}, out
    status, _ = refit_cli(["verify", "--plan", "nope", "--coordinator", fleet.server.address])
    assert status == 2  # an unknown plan: a bad request


def _listed(fleet: ProcCluster, wid: str) -> tuple[int, bool]:
    return _holding(fleet)[wid]


@bounded(120)
def test_a_replica_joins_and_is_caught_up_before_it_serves(fleet: ProcCluster) -> None:
    """A fourth replica starts mid-run (``vllm:tp1dp4`` rank 3, holding its initial weights) and
    registers into the engine group: it is listed at version 0 — not to be sent requests.  The
    same Refit call with the version the plan committed (trainers still hold it) is a catch-up:
    only the newcomer receives, under the same plan id, and then holds exactly the trainers'
    weights of that version.  The next refit moves all four."""
    v = fleet.version
    refits_before = {e.worker_id: e.ask("state") for e in fleet.engines}
    joiner = fleet.add(Worker(fleet.server.address, "engine", "engine", 3, "vllm:tp1dp4", model=fleet.model))
    assert _settle(lambda: "engine/3" in _holding(fleet)) and _listed(fleet, "engine/3") == (0, False)
    assert joiner.ask("check", v) != []  # it holds other weights
    r = fleet.client.refit(fleet.plan, v, timeout=20.0)
    assert r.ok and r.plan_id == fleet.plan, r
    assert set(r.workers) == {"trainer/0", "trainer/1", "engine/3"}, r.workers
    assert joiner.ask("check", v) == [] and _settle(lambda: joiner.ask("state") == (v, False, True))
    assert _listed(fleet, "engine/3") == (v, False)
    assert {e.worker_id: e.ask("state") for e in fleet.engines if e is not joiner} == refits_before
    fleet.refit_ok(v + 1)  # all four, as vllm:tp1dp4
    assert fleet.client.get_plan(fleet.plan)["dst_layout"] == "vllm:tp1dp4"


@bounded(120)
def test_a_killed_replica_is_dropped_then_replaced(fleet: ProcCluster) -> None:
    """A replica is SIGKILLed.  A refit at once fails naming it (it may be reconnecting); once it
    has been gone ``drop_after`` the refit runs for the replicas still there.  A replacement starts
    in its slot holding its initial weights, is caught up alone, and the next refit moves all."""
    victim = "engine/1"
    fleet.workers[victim].kill()
    v = fleet.version + 1
    fleet.fill(v)
    r = fleet.client.refit(fleet.plan, v, timeout=10.0, check=False)
    assert not r.ok and f"{victim} not connected" in r.error, r.error
    time.sleep(DROP_AFTER + 0.2)
    r = fleet.client.refit(fleet.plan, v, timeout=20.0)
    assert r.ok and victim not in r.workers and len(r.workers) == len(fleet.workers) - 1, r
    fleet.version = v
    for e in fleet.engines:
        if e.worker_id != victim:
            assert e.ask("check", v) == [] and _settle(lambda e=e: e.ask("state") == (v, False, True)), e.worker_id
    fleet.replace(victim, version=0)
    r = fleet.client.refit(fleet.plan, v, timeout=20.0)
    assert r.ok and set(r.workers) == {"trainer/0", "trainer/1", victim}, r
    assert fleet.workers[victim].ask("check", v) == [] and _listed(fleet, victim) == (v, False)
    fleet.refit_ok(v + 1)
    assert all(h == (v + 1, False) for h in _holding(fleet).values())


def refit_cli(argv: list[str]) -> tuple[int, str]:
    """`refit ARGV` in this process: (exit status, stdout)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli_main(argv)
    return status, out.getvalue()


class FailingSwitch(EngineAgent):
    """An engine whose switch to a staged version raises (a device error mid-copy, say)."""

    def _switch(self, staged, live):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected: the switch failed")


@contextlib.contextmanager
def noop_team(*engines: tuple[type, str, int, dict], start: bool = True):
    """A coordinator, a trainer t/0 (megatron:tp1) and engines of group e — (class, layout, rank,
    extra arguments) — over the no-op data plane, in this process: (server, client, agents)."""
    srv = ThreadedServer()
    spec = tiny_spec("tiny-qwen2")
    team = [TrainerAgent(srv.address, group="t", rank=0, spec=spec, layout="megatron:tp1", data_plane=NoopDataPlane())]
    team += [cls(srv.address, group="e", rank=rank, spec=spec, layout=layout, data_plane=NoopDataPlane(), **kw)
             for cls, layout, rank, kw in engines]
    try:
        if start:
            for a in team:
                a.start()
        with Client(srv.address) as c:
            yield srv, c, team
    finally:
        for a in team:
            a.stop()
        srv.stop()


@bounded(30)
def test_an_engine_that_fails_to_switch_is_named_and_listed_stale() -> None:
    """The one window of an atomic refit that cannot be undone: every engine staged, the
    coordinator said switch, and one engine's switch failed.  The refit fails naming it; it is
    listed stale, the other engine holds the new version; the next version lands on both."""
    with noop_team((EngineAgent, "vllm:tp1dp2", 0, {}), (FailingSwitch, "vllm:tp1dp2", 1, {})) as (_, c, team):
        plan = c.create_plan("t", "e")["plan_id"]
        r = c.refit(plan, 1, atomic=True, check=False)
        assert not r.ok and "1 engine(s) did not switch" in r.error and "e/1: RuntimeError: injected" in r.error, r
        assert r.workers["e/1"].outcome == "error" and r.workers["e/0"].outcome == "ok"
        held = {w["worker_id"]: (w["version"], w["stale"]) for w in c.list_workers(role="engine")}
        assert held == {"e/0": (1, False), "e/1": (0, True)}, held
        assert _settle(lambda: (team[2].version, team[2].stale) == (0, True))
        team[2].__class__ = EngineAgent  # repaired
        assert c.refit(plan, 2, atomic=True).ok
        assert {w["worker_id"]: (w["version"], w["stale"]) for w in c.list_workers(role="engine")} == \
            {"e/0": (2, False), "e/1": (2, False)}


@bounded(30)
def test_watchers_see_workers_join_and_leave() -> None:
    """Membership changes reach every watcher (whatever plan it watches) as they happen: an engine
    that registers, one that leaves, and one that dies (its stream ends)."""
    with noop_team((EngineAgent, "vllm:tp1", 0, {}), start=False) as (srv, c, team):
        seen: list[tuple[str, str, bool]] = []
        stream = c.watch()

        def watch() -> None:
            for e in stream:
                seen.append((e["kind"], e["member"]["worker_id"], e["member"]["connected"]))
                if len(seen) == 2:
                    return

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        coord = srv.server.coord
        assert _settle(lambda: srv.call(lambda: bool(coord.events)))
        team[1].start()
        team[1].stop()
        t.join(10)
        assert seen == [("KIND_WORKER_JOINED", "e/0", True), ("KIND_WORKER_LEFT", "e/0", False)], seen
        stream.close()


@bounded(30)
def test_atomic_refits_refuse_an_engine_that_writes_in_place() -> None:
    with noop_team((EngineAgent, "vllm:tp1", 0, {"stages": False})) as (_, c, _team):
        plan = c.create_plan("t", "e")["plan_id"]
        with pytest.raises(InvalidRequest, match="e/0 write in place and cannot stage"):
            c.refit(plan, 1, atomic=True)
        assert c.refit(plan, 1).ok  # the default refit is not refused


# ------------------------------------------------------------------------------------------------
# A member that fails before the rendezvous: nobody waits for it, and nothing is said to have moved


LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
             vocab_size=129, tie_word_embeddings=False, dtype="bfloat16")


@pytest.fixture(scope="module")
def coordinator_timeout() -> float:
    """The shared ``server`` (tests/conftest.py) of the attach trials, with 60 s for refits."""
    return 60.0


def _busy(client: Client) -> list[str]:
    return [w["worker_id"] for w in client.list_workers() if w["busy_refit"]]


def _until(cond: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``cond()`` held (polled every 5 ms); fails past ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached in time"
        time.sleep(0.005)
    return time.monotonic() - t0


@bounded(120)
def test_a_refit_refused_before_the_rendezvous_stalls_nobody(server) -> None:
    """The repro: attach, refit, re-point ``model.lm_head.weight.data`` to a float32 copy (the
    trainer refuses before it meets its peers: a tensor of another dtype than it registered), refit
    twice, put it back in bf16, refit — all with a 60 s timeout.  The engines
    used to wait in the rendezvous for the trainer's record until that timeout, and the last refit
    behind them (58.8 s measured).  Now the coordinator aborts the rendezvous as it reports the
    failure: every member is free again at once, and the last refit takes well under 2 s.  The
    refused refits moved nothing: the engines keep reporting version 1, not stale."""
    from refit.control.client import RefitFailed
    from refit.integrations import hf as refit_hf
    from tests.harness.attach_cluster import Engines, make_hf_model

    srv, client = server
    model = make_hf_model("LlamaForCausalLM", **LLAMA)
    agent = refit_hf.attach(model, srv.address, group="early")
    engines = Engines(srv.address, agent.spec, "vllm:tp2", group="early-engine")
    try:
        plan = client.create_plan("early", "early-engine")["plan_id"]
        assert client.refit(plan, version=1, timeout=60).ok
        model.lm_head.weight.data = model.lm_head.weight.data.float()
        for version in (2, 3):
            t0 = time.monotonic()
            with pytest.raises(RefitFailed, match="'lm_head.weight' is float32, expected bfloat16"):
                client.refit(plan, version=version, timeout=60)
            # every member leaves within a moment of the failure (measured: a few ms)
            left = _until(lambda: not _busy(client), 5.0)
            assert time.monotonic() - t0 < 3.0 and left < 0.5, (time.monotonic() - t0, left)
            _until(lambda: [(a.version, a.stale) for a in engines.agents] == [(1, False)] * 2, 5.0)
            assert {(w["version"], w["stale"]) for w in client.list_workers(group="early-engine")} == {(1, False)}
        model.lm_head.weight.data = model.lm_head.weight.data.bfloat16()  # followed: no attach again
        t0 = time.monotonic()
        assert client.refit(plan, version=4, timeout=60).ok
        assert time.monotonic() - t0 < 2.0
        _until(lambda: [(a.version, a.stale) for a in engines.agents] == [(4, False)] * 2, 5.0)
    finally:
        agent.stop()
        engines.close()


class Refusing:
    """An engine's phase hook that refuses plans while ``refuse`` is set (as a vLLM engine refuses
    a refit it is not inside ``update_weights`` for), before any byte moves."""

    def __init__(self) -> None:
        self.refuse = False

    def check(self, plan: Any) -> None:
        if self.refuse:
            raise RefitError("not inside update_weights for this plan")

    def landed(self, plan: Any, phase: int) -> None:
        pass


@bounded(120)
def test_a_refit_refused_by_an_engine_leaves_its_version_and_staleness(server) -> None:
    """A refit an engine refuses before any byte moves (here a phase hook's check, as vLLM's
    backend refuses a refit outside ``update_weights``) used to mark every engine stale for good;
    it must change nothing an engine is said to hold, on the engine and at the coordinator."""
    from refit.control.client import RefitFailed
    from refit.layouts import resolve_layout
    from tests.harness.control_cluster import fill

    srv, client = server
    spec = tiny_spec("tiny-qwen3-moe")
    src, dst = resolve_layout("megatron:tp1", spec, Side.TRAINER), resolve_layout("vllm:tp2", spec, Side.ENGINE)
    trainer_tensors = fill(spec, src, 0, 1)
    got = [fill(spec, dst, r, 0) for r in range(2)]
    hooks = [Refusing(), Refusing()]
    agents = [TrainerAgent(srv.address, group="refuse-t", rank=0, spec=spec, layout=src,
                           tensors=trainer_tensors).start()]
    agents += [EngineAgent(srv.address, group="refuse-e", rank=r, spec=spec, layout=dst, tensors=got[r],
                           phase_hook=hooks[r]).start() for r in range(2)]
    try:
        plan = client.create_plan("refuse-t", "refuse-e")["plan_id"]
        assert client.refit(plan, version=1, timeout=30).ok
        hooks[1].refuse = True
        fill(spec, src, 0, 2, trainer_tensors)
        with pytest.raises(RefitFailed, match="refuse-e/1 error: RefitError: not inside update_weights"):
            client.refit(plan, version=2, timeout=30)
        _until(lambda: not _busy(client), 5.0)
        _until(lambda: [(a.version, a.stale) for a in agents[1:]] == [(1, False)] * 2, 5.0)
        assert {(w["version"], w["stale"]) for w in client.list_workers(group="refuse-e")} == {(1, False)}
        assert all(not [n for n in want if not want[n].equal(got[r][n])]
                   for r, want in enumerate(fill(spec, dst, r, 1) for r in range(2)))  # untouched
        hooks[1].refuse = False
        assert client.refit(plan, version=3, timeout=30).ok  # (v2's bytes are the trainer's now)
        _until(lambda: [(a.version, a.stale) for a in agents[1:]] == [(3, False)] * 2, 5.0)
        assert {(w["version"], w["stale"]) for w in client.list_workers(group="refuse-e")} == {(3, False)}
        assert all(not [n for n in want if not want[n].equal(got[r][n])]
                   for r, want in enumerate(fill(spec, dst, r, 2) for r in range(2)))
    finally:
        for a in agents:
            a.stop()


@bounded(120)
def test_a_raw_agent_follows_its_model_through_a_cast_and_a_step(server, tmp_path) -> None:
    """A `TrainerAgent` given ``tensors`` as a callable reads them at every refit: after
    ``model.float(); model.bfloat16()`` (every parameter re-pointed to new storage) and a training
    step, the engines hold the new weights bit for bit — they used to keep the old ones while
    reporting the new version."""
    from refit.integrations._common import spec_of_hf_config
    from refit.layouts import HFLayout
    from tests.harness.attach_cluster import Engines, expected_engine_tensors, make_hf_model, train_step

    srv, client = server
    model = make_hf_model("LlamaForCausalLM", seed=3, **LLAMA)
    spec = spec_of_hf_config(model.config, dict(model.named_parameters()))
    agent = TrainerAgent(srv.address, group="follow", rank=0, spec=spec, layout=HFLayout(),
                         tensors=lambda: {n: p.detach() for n, p in model.named_parameters()}).start()
    engines = Engines(srv.address, spec, "vllm:tp2", group="follow-engine")
    try:
        plan = client.create_plan("follow", "follow-engine")["plan_id"]
        for version in (1, 2, 3):
            if version > 1:
                model.float()
                model.bfloat16()
                train_step(model, seed=version)
            assert client.refit(plan, version=version, timeout=60).ok
            model.save_pretrained(tmp_path / f"v{version}")
            bad = engines.mismatches(expected_engine_tensors(spec, "vllm:tp2", str(tmp_path / f"v{version}")))
            assert not bad, (version, bad[:5])
    finally:
        agent.stop()
        engines.close()


class FailsAfterLocating(ExecutorDataPlane):
    """An engine data plane that fails once its peers know where it sits, before its control
    group exists: the trainer is then inside gloo's group set-up, waiting for this member's
    address in the rendezvous."""

    def _run_view(self, plan: Any) -> Any:
        raise RefitError("injected: refusing after locate")


@bounded(60)
def test_a_member_failing_inside_set_up_frees_its_peers_at_once(server) -> None:
    """The trainer waits in gloo's group set-up (a rendezvous wait inside torch's C++) for an
    engine that failed after publishing its device: the coordinator's abort reaches into that
    wait, and the trainer is free within a moment, not at the 60 s deadline."""
    from refit.control.client import RefitFailed
    from refit.layouts import resolve_layout
    from tests.harness.control_cluster import fill

    srv, client = server
    spec = tiny_spec("tiny-qwen3-moe")
    src, dst = resolve_layout("megatron:tp1", spec, Side.TRAINER), resolve_layout("vllm:tp1", spec, Side.ENGINE)
    agents = [TrainerAgent(srv.address, group="setup-t", rank=0, spec=spec, layout=src, tensors=fill(spec, src, 0, 1)),
              EngineAgent(srv.address, group="setup-e", rank=0, spec=spec, layout=dst, tensors=fill(spec, dst, 0, 0),
                          data_plane=FailsAfterLocating())]
    for a in agents:
        a.start()
    try:
        plan = client.create_plan("setup-t", "setup-e")["plan_id"]
        t0 = time.monotonic()
        with pytest.raises(RefitFailed, match="injected: refusing after locate"):
            client.refit(plan, version=1, timeout=60)
        freed = _until(lambda: not _busy(client), 5.0)
        assert time.monotonic() - t0 < 3.0 and freed < 0.5, (time.monotonic() - t0, freed)
    finally:
        for a in agents:
            a.stop()
