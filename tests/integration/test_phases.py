"""Phased refits (`refit.phases`), tiny Qwen3-MoE megatron:tp2ep2 -> vllm:tp2 on CPU over gloo:

* four real `Member`s (threads of this process, a real TCPStore, real gloo groups) run a plan cut
  into one-layer phases: when phase k lands, every engine holds the new values in exactly the rows
  of phases <= k and the old ones elsewhere; staging is shared across phases;
* the same through the real gRPC control plane: engine agents declaring ``phase_layers=1`` with a
  `PhaseHook` hear every phase once, in order; a hook refusing the plan fails the refit naming its
  worker with no engine tensor changed, and so does a landing that raises; a group declaring two
  different ``phase_layers`` is refused.

Most members and agents share this process (the hooks are then checked directly, and no process
start-up is paid); one test runs each agent in a process of its own, as a real deployment does.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

import grpc
import pytest
import torch.distributed as dist

from refit.control.agent import EngineAgent, TrainerAgent
from refit.control.client import RefitFailed
from refit.control.dataplane import NoopDataPlane
from refit.executor.member import Budget, Member
from refit.executor.seating import connect
from refit.executor.topology import Topology
from refit.layouts import resolve_layout
from refit.phases import WHOLE
from refit.plan import Plan
from refit.planners import make_plan
from refit.sides import Side
from tests.harness.control_cluster import DST, MODEL, SRC, fill
from tests.harness.phases import AgentProcess, RecordingHook, differing, mixed_canonical, rank_tensors
from tests.harness.tiny import tiny_spec
from tests.harness.procs import together

SPEC = tiny_spec(MODEL)
LAYOUTS = {Side.TRAINER: resolve_layout(SRC, SPEC, Side.TRAINER), Side.ENGINE: resolve_layout(DST, SPEC, Side.ENGINE)}


def _together(fns: list[Callable[[], Any]], timeout: float = 120.0) -> list[Any]:
    return together(fns, timeout)


def _landing_checker(plan: Plan, rank: int, tensors: dict, old: int, new: int, seen: list) -> Callable[[int], None]:
    """An engine's ``on_phase``: record (key, local tensors not holding exactly the mix expected)."""
    def on_phase(key: int) -> None:
        want = fill(SPEC, LAYOUTS[Side.ENGINE], rank, new) if key == WHOLE else \
            rank_tensors(SPEC, LAYOUTS[Side.ENGINE], rank, mixed_canonical(SPEC, old, new, plan, key))
        seen.append((key, differing(want, tensors)))
    return on_phase


def test_member_refits_a_phased_plan_phase_by_phase_over_shared_staging() -> None:
    phased = make_plan(SPEC, SRC, DST, "disaggregated", "p2p", 4096, phase_layers=1).plan
    whole = make_plan(SPEC, SRC, DST, "disaggregated", "p2p", 4096).plan
    keys = [k for k, _ in phased.phases]
    assert len(keys) == 3 + SPEC.config.num_layers  # embeddings, final norm, LM head; one phase per layer
    topo = Topology.one_per_rank(phased.placement)  # four CPU devices: every box crosses gloo
    eps = [ep for (ep,) in topo.members]
    names = [f"{s.value}/{r}" for s, r in eps]
    tensors = {ep: fill(SPEC, LAYOUTS[ep[0]], ep[1], 1 if ep[0] is Side.TRAINER else 0) for ep in eps}
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    prefix = uuid.uuid4().hex[:8]

    def member(m: int) -> Member:
        store = connect("127.0.0.1", master.port, prefix, 30.0)
        return Member(store, topo, m, "cpu", {eps[m]: tensors[eps[m]]}, SPEC, LAYOUTS[Side.TRAINER],
                      LAYOUTS[Side.ENGINE], names, Budget(60.0)).prepare(phased)

    members = _together([lambda m=m: member(m) for m in range(len(eps))])
    assert all(isinstance(m, Member) for m in members), members
    try:
        # Phase by phase: each phase lands whole, later phases untouched (the first phase's mix is
        # not already the final state: the check could fail).
        first = rank_tensors(SPEC, LAYOUTS[Side.ENGINE], 0, mixed_canonical(SPEC, 0, 1, phased, keys[0]))
        assert differing(first, fill(SPEC, LAYOUTS[Side.ENGINE], 0, 1))
        seen: dict[int, list] = {m: [] for m in range(len(eps))}
        hooks = [None if ep[0] is Side.TRAINER else _landing_checker(phased, ep[1], tensors[ep], 0, 1, seen[m])
                 for m, ep in enumerate(eps)]
        out = _together([lambda m=m: members[m].refit(Budget(60.0), on_phase=hooks[m]) for m in range(len(eps))])
        assert all(isinstance(s, float) for s in out), out
        for m, ep in enumerate(eps):
            assert seen[m] == ([] if ep[0] is Side.TRAINER else [(k, []) for k in keys]), (ep, seen[m])
            assert not differing(fill(SPEC, LAYOUTS[ep[0]], ep[1], 1), tensors[ep])

        # Staging: one buffer set shared by every phase, no larger than the unphased plan's.
        for m in members:
            assert len(m.phases) == len(keys)
            assert all(b is not None and b.buffers is m.phases[0][1].buffers for _, b in m.phases)
        phased_staging = [m.staging_bytes for m in members]
        _together([lambda m=m: m.prepare(whole) for m in members])
        whole_staging = [m.staging_bytes for m in members]
        assert any(phased_staging) and all(p <= w for p, w in zip(phased_staging, whole_staging)), \
            (phased_staging, whole_staging)

        # The unphased plan on the same members: one phase, keyed WHOLE, still bit-exact.
        for ep in eps:
            if ep[0] is Side.TRAINER:
                fill(SPEC, LAYOUTS[Side.TRAINER], ep[1], 2, tensors[ep])
        seen = {m: [] for m in range(len(eps))}
        hooks = [None if ep[0] is Side.TRAINER else _landing_checker(whole, ep[1], tensors[ep], 1, 2, seen[m])
                 for m, ep in enumerate(eps)]
        out = _together([lambda m=m: members[m].refit(Budget(60.0), on_phase=hooks[m]) for m in range(len(eps))])
        assert all(isinstance(s, float) for s in out), out
        assert [seen[m] for m in range(2, 4)] == [[(WHOLE, [])]] * 2

        # A phase barrier that times out says which phase, and who never came.
        members[3].prepare(phased)
        with pytest.raises(TimeoutError, match=r"phase 0 start barrier; waiting on trainer/0, trainer/1, engine/0"):
            members[3].refit(Budget(0.5))
    finally:
        for m in members:
            if isinstance(m, Member):
                m.close()


# ------------------------------------------------------------------ through the control plane


def test_phased_refit_through_the_control_plane(make_coordinator) -> None:
    server, client = make_coordinator(default_timeout=30.0)
    trainer_tensors = [fill(SPEC, LAYOUTS[Side.TRAINER], r, 1) for r in range(2)]
    engine_tensors = [fill(SPEC, LAYOUTS[Side.ENGINE], r, 0) for r in range(2)]
    hooks = [RecordingHook(SPEC, LAYOUTS[Side.ENGINE], r, engine_tensors[r]) for r in range(2)]
    agents = [TrainerAgent(server.address, group="trainer", rank=r, spec=SPEC, layout=SRC, tensors=trainer_tensors[r])
              for r in range(2)]
    agents += [EngineAgent(server.address, group="engine", rank=r, spec=SPEC, layout=DST, tensors=engine_tensors[r],
                           phase_layers=1, phase_hook=hooks[r]) for r in range(2)]
    try:
        for a in agents:
            a.start()
        summary = client.create_plan("trainer", "engine", bucket_bytes=4096)
        plan = client.get_plan(summary["plan_id"], include_plan=True)["plan"]
        keys = [k for k, _ in plan.phases]
        assert plan.phase_layers == 1 and summary["num_phases"] == len(keys) == 3 + SPEC.config.num_layers
        assert client.refit(summary["plan_id"], version=1, timeout=30.0).ok
        for h in hooks:
            assert h.checked == [plan.plan_hash] and h.calls == [(k, []) for k in keys], h.calls
            assert not differing(fill(SPEC, LAYOUTS[Side.ENGINE], h.rank, 1), h.tensors)

        # A hook refusing the plan: the refit fails naming that engine, before any byte moves.
        for r in range(2):
            fill(SPEC, LAYOUTS[Side.TRAINER], r, 2, trainer_tensors[r])
        hooks[1].refuse = True
        for h in hooks:
            h.calls.clear()
        with pytest.raises(RefitFailed, match=r"engine/1.*cannot land plan") as e:
            client.refit(summary["plan_id"], version=2, timeout=5.0)
        assert "\n" not in str(e.value)
        for h in hooks:
            assert h.calls == [] and not differing(fill(SPEC, LAYOUTS[Side.ENGINE], h.rank, 1), h.tensors)
        hooks[1].refuse = False
        for r in range(2):
            fill(SPEC, LAYOUTS[Side.TRAINER], r, 3, trainer_tensors[r])
        for h in hooks:
            h.old, h.new = 1, 3
        assert client.refit(summary["plan_id"], version=3, timeout=30.0).ok  # and it recovers
        for h in hooks:
            assert h.calls == [(k, []) for k in keys] and not differing(fill(SPEC, LAYOUTS[Side.ENGINE], h.rank, 3), h.tensors)

        # A landing that raises fails the refit naming that engine; no later phase starts; the
        # engines are stale until the next refit succeeds.
        for version, fail_at in ((4, keys[2]), (5, None)):
            for r in range(2):
                fill(SPEC, LAYOUTS[Side.TRAINER], r, version, trainer_tensors[r])
            for h in hooks:
                h.calls.clear()
                h.old, h.new = (3, 4) if version == 4 else (4, 5)
            hooks[0].fail_at = fail_at
            result = client.refit(summary["plan_id"], version=version, timeout=30.0, check=False)
            if fail_at is None:
                assert result.ok
                continue
            assert not result.ok and "engine/0 error: RuntimeError: applying phase 2 failed" in result.error, result.error
            assert [k for k, _ in hooks[0].calls] == keys[:3] and [k for k, _ in hooks[1].calls] == keys[:3]
            assert all(r["stale"] and r["version"] == 3 for r in client.list_workers(group="engine"))
        for h in hooks:  # (phases 0-2 held version 4 before it, the rest 3: only the order is checked)
            assert [k for k, _ in h.calls] == keys and not differing(fill(SPEC, LAYOUTS[Side.ENGINE], h.rank, 5), h.tensors)
        assert all(not r["stale"] and r["version"] == 5 for r in client.list_workers(group="engine"))
    finally:
        for a in agents:
            a.stop()
            a.data_plane.close()


def test_phase_layers_must_agree_and_key_the_plan_cache(make_coordinator) -> None:
    server, client = make_coordinator(default_timeout=10.0)

    def agent(cls: type, group: str, rank: int, layout: str, phase_layers: int = 0) -> Any:
        return cls(server.address, group=group, rank=rank, spec=SPEC, layout=layout, data_plane=NoopDataPlane(),
                   phase_layers=phase_layers).start()

    agents = [agent(TrainerAgent, "trainer", r, SRC) for r in range(2)]
    try:
        mixed = [agent(EngineAgent, "mixed", 0, DST, 1), agent(EngineAgent, "mixed", 1, DST, 2)]
        agents += mixed
        with pytest.raises(grpc.RpcError) as e:
            client.create_plan("trainer", "mixed")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "group 'mixed': mixed/1 declares phase_layers 2, mixed/0 1" in e.value.details(), e.value.details()
        # The same group re-registered with other phase_layers gets another plan, not the cached one.
        plans = []
        for layers in (1, 2, 0):
            for a in mixed:
                a.stop()
            mixed = [agent(EngineAgent, "mixed", r, DST, layers) for r in range(2)]
            agents += mixed
            plans.append(client.create_plan("trainer", "mixed"))
        assert len({p["plan_hash"] for p in plans}) == 3 and not any(p["cached"] for p in plans)
        assert [p.get("num_phases", 0) for p in plans] == [3 + SPEC.config.num_layers, 3 + 2, 0]
        with pytest.raises(grpc.RpcError, match="cannot be cut into phases"):
            mixed2 = [agent(EngineAgent, "bcast", r, DST, 1) for r in range(2)]
            agents += mixed2
            client.create_plan("trainer", "bcast", planner="broadcast")
    finally:
        for a in agents:
            a.stop()


def test_phased_refit_with_an_agent_per_process(make_coordinator) -> None:
    server, client = make_coordinator(default_timeout=30.0)
    procs = [AgentProcess(server.address, "trainer", r) for r in range(2)]
    procs += [AgentProcess(server.address, "engine", r, phase_layers=2) for r in range(2)]
    try:
        for p in procs:
            p.ask("ready")
        summary = client.create_plan("trainer", "engine", bucket_bytes=4096)
        plan = client.get_plan(summary["plan_id"], include_plan=True)["plan"]
        keys = [k for k, _ in plan.phases]
        assert plan.phase_layers == 2 and len(keys) == 3 + 2
        for version in (1, 2):
            for p in procs[:2]:
                p.ask("fill", version)
            for p in procs[2:]:
                p.ask("versions", (version - 1, version))
            assert client.refit(summary["plan_id"], version=version, timeout=30.0).ok
            for p in procs[2:]:
                assert p.ask("calls") == [(k, []) for k in keys] and p.ask("check", version) == []
    finally:
        for p in procs:
            p.close()
