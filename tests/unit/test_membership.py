"""Elastic engine groups (refit.control.membership) as the coordinator runs them, without processes:
the stand-in members of test_coordinator.py answer every run.  A group of three dense vLLM
replicas loses one (left out once gone past ``drop_after``, the plan id unchanged), gains a fourth
and gets the dead one back (each caught up alone to the committed version), and the plan of each
set of replicas is made once and given back.  A MoE group is rigid: a dead rank fails its refits
however long it has been gone."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from refit.control.common import config_json
from refit.control.coordinator import Coordinator
from refit.control.membership import engine_view, interchangeable, layout_with, within_replica
from refit.control.v1 import refit_pb2 as pb
from refit.errors import InvalidInput
from refit.layouts import resolve_layout
from refit.plan import Plan
from refit.sides import Side
from tests.harness.tiny import tiny_spec
from tests.unit.test_coordinator import Member, responder, run


def replicas(coord: Coordinator, plan_id: str) -> tuple[str, ...]:
    entry = coord.plans[plan_id]
    return entry.members[entry.num_src:]


async def elastic(n: int = 3, drop_after: float = 0.2, model: str = "tiny-qwen2",
                  **kw: Any) -> tuple[Coordinator, list[Member], str]:
    coord = Coordinator(drop_after=drop_after, **kw)
    members = [await Member(coord, pb.ROLE_TRAINER, "t", r, "megatron:tp2").register() for r in range(2)]
    members += [await Member(coord, pb.ROLE_ENGINE, "e", r, f"vllm:tp1dp{n}").register() for r in range(n)]
    entry, _ = await coord.create_plan("t", "e", pb.PlanOptions())
    return coord, members, entry.plan_id


def engine(coord: Coordinator, rank: int, layout: str, pid: int) -> Member:
    m = Member(coord, pb.ROLE_ENGINE, "e", rank, layout)
    m.info.pid = pid
    return m


def ran(m: Member) -> list[pb.RunRefit]:
    return [msg.run for msg in m.sent if msg.WhichOneof("kind") == "run"]


def test_replicas_leave_join_and_come_back_under_one_plan_id() -> None:
    async def main() -> None:
        coord, members, plan_id = await elastic()
        task = responder(members)
        assert (await coord.refit(plan_id, 1, 5)).status == pb.REFIT_STATUS_OK
        dp3 = coord.plans[plan_id].plan
        assert dp3.dst_layout == "vllm:tp1dp3"

        coord.disconnected(members[3].worker, "killed")  # e/1 dies
        resp = await coord.refit(plan_id, 2, 5)  # at once: it may be reconnecting, so it is named
        assert resp.status == pb.REFIT_STATUS_FAILED and "e/1 not connected" in resp.error
        await asyncio.sleep(0.25)  # past drop_after: the refit runs for replicas 0 and 2
        resp = await coord.refit(plan_id, 2, 5)
        assert resp.status == pb.REFIT_STATUS_OK and resp.plan_id == plan_id
        assert replicas(coord, plan_id) == ("e/0", "e/2")
        assert coord.plans[plan_id].plan.dst_layout == "vllm:tp1dp2"
        last = ran(members[4])[-1]  # e/2 plays rank 1 of vllm:tp1dp2: member 3 of the rendezvous
        assert (last.rendezvous.rank, last.rendezvous.world_size) == (3, 4)
        assert Plan.from_dict(json.loads(last.plan_json)).dst_layout == "vllm:tp1dp2"
        assert [w.version for w in map(lambda m: m.worker, members[2:])] == [2, 1, 2]

        # A fourth replica starts (vLLM --data-parallel-size 4 --data-parallel-rank 3) and the
        # dead one is replaced: the same version brings just them to it, one catch-up.
        joiner = await engine(coord, 3, "vllm:tp1dp4", 2000).register()
        back = await engine(coord, 1, "vllm:tp1dp3", 2001).register()
        task.cancel()
        task = responder(members + [joiner, back])
        before = {m.worker.worker_id: len(ran(m)) for m in members[2:] if m.worker.connected}
        resp = await coord.refit(plan_id, 2, 5)
        assert resp.status == pb.REFIT_STATUS_OK
        assert {r.worker_id for r in resp.workers} == {"t/0", "t/1", "e/1", "e/3"}
        assert {m.worker.worker_id: len(ran(m)) for m in members[2:] if m.worker.connected} == before
        assert (joiner.worker.version, back.worker.version) == (2, 2)
        assert not joiner.worker.stale and coord.plans[plan_id].version == 2
        # everyone holds 2: the committed response again, nothing runs
        again = await coord.refit(plan_id, 2, 5)
        assert again.refit_id != resp.refit_id and len(ran(joiner)) == 1

        resp = await coord.refit(plan_id, 3, 5)  # all four
        assert resp.status == pb.REFIT_STATUS_OK
        assert replicas(coord, plan_id) == ("e/0", "e/1", "e/2", "e/3")
        assert coord.plans[plan_id].plan.dst_layout == "vllm:tp1dp4"
        coord.disconnected(joiner.worker, "killed")
        coord.disconnected(back.worker, "killed")
        await asyncio.sleep(0.25)
        assert (await coord.refit(plan_id, 4, 5)).status == pb.REFIT_STATUS_OK
        assert coord.plans[plan_id].plan is not dp3  # dp2 again: the plan made for it before
        assert coord.plans[plan_id].plan.dst_layout == "vllm:tp1dp2"
        task.cancel()
        await coord.close()

    run(main())


def test_a_registered_version_cannot_block_the_fleet() -> None:
    """A replica may not claim a version its group never had (10^6, 2^53-1): refused when it
    registers, naming it.  One that claimed a version before any plan into its group (a coordinator
    restarted) stops counting once gone: the refits of the others go on."""
    async def main() -> None:
        coord, members, plan_id = await elastic(n=3)
        task = responder(members)
        assert (await coord.refit(plan_id, 1, 5)).status == pb.REFIT_STATUS_OK
        for claim in (10**6, 2**53 - 1):
            rogue = engine(coord, 3, "vllm:tp1dp4", 3000)
            rogue.info.version = claim
            with pytest.raises(InvalidInput, match=f"register: version {claim} is above 1, the most engine group 'e'"):
                await rogue.register()
        joiner = engine(coord, 3, "vllm:tp1dp4", 3001)
        joiner.info.version = 1  # what its group holds: accepted
        await joiner.register()
        task.cancel()
        task = responder(members + [joiner])
        assert (await coord.refit(plan_id, 2, 5)).status == pb.REFIT_STATUS_OK
        task.cancel()
        await coord.close()

        # Restarted coordinator (no plan yet): engines claim what they hold; gone, one no longer counts.
        coord = Coordinator(drop_after=0.2)
        members = [await Member(coord, pb.ROLE_TRAINER, "t", r, "megatron:tp2").register() for r in range(2)]
        members += [await Member(coord, pb.ROLE_ENGINE, "e", 0, "vllm:tp1dp3", version=10**6).register()]
        members += [await Member(coord, pb.ROLE_ENGINE, "e", r, "vllm:tp1dp3").register() for r in (1, 2)]
        entry, _ = await coord.create_plan("t", "e", pb.PlanOptions())
        with pytest.raises(InvalidInput, match="not above 1000000, the version e/0 holds"):
            await coord.refit(entry.plan_id, 1, 5)
        coord.disconnected(members[2].worker, "left")
        await asyncio.sleep(0.25)  # past drop_after
        task = responder(members)
        assert (await coord.refit(entry.plan_id, 1, 5)).status == pb.REFIT_STATUS_OK
        assert replicas(coord, entry.plan_id) == ("e/1", "e/2")
        task.cancel()
        await coord.close()

    run(main())


def test_replicas_that_cannot_be_refitted_are_refused_when_they_register() -> None:
    """A replica of another layout (vllm:tp2dp3 into vllm:tp1dpN: it was left out of refits yet
    listed connected) or of another model (every refit failed while it stayed) is refused when it
    registers, naming the difference; a fitting one joins."""
    async def main() -> None:
        coord, members, plan_id = await elastic(n=3)
        wide = engine(coord, 3, "vllm:tp2dp3", 4000)
        with pytest.raises(InvalidInput, match=r"register: e/3 registered layout vllm:tp2dp3, e/0 vllm:tp1dp3 "
                                                r"\(one replica: vllm:tp2, vllm:tp1\)"):
            await wide.register()
        other = engine(coord, 3, "vllm:tp1dp4", 4001)
        llama = tiny_spec("tiny-llama")
        other.info.model_name, other.info.model_digest = llama.name, llama.digest()
        other.info.model_config_json = config_json(llama.config)
        with pytest.raises(InvalidInput, match="register: e/0 and e/3 hold different model configs: .*vocab_size"):
            await other.register()
        assert {w.worker_id for w in coord.workers.values()} == {"t/0", "t/1", "e/0", "e/1", "e/2"}
        await engine(coord, 3, "vllm:tp1dp4", 4002).register()
        await coord.close()

    run(main())


def test_plan_made_once_per_set_of_replicas() -> None:
    async def main() -> None:
        coord, members, plan_id = await elastic()
        task = responder(members)
        assert (await coord.refit(plan_id, 1, 5)).status == pb.REFIT_STATUS_OK
        coord.disconnected(members[2].worker, "killed")
        await asyncio.sleep(0.25)
        assert (await coord.refit(plan_id, 2, 5)).status == pb.REFIT_STATUS_OK
        dp2 = coord.plans[plan_id].plan
        back = await engine(coord, 0, "vllm:tp1dp3", 2000).register()
        task.cancel()
        task = responder(members + [back])
        assert (await coord.refit(plan_id, 3, 5)).status == pb.REFIT_STATUS_OK
        coord.disconnected(back.worker, "killed")
        await asyncio.sleep(0.25)
        assert (await coord.refit(plan_id, 4, 5)).status == pb.REFIT_STATUS_OK
        assert coord.plans[plan_id].plan is dp2
        # create_plan on the same groups gives the same plan id back, whatever the replicas
        entry, _ = await coord.create_plan("t", "e", pb.PlanOptions())
        assert entry.plan_id == plan_id
        task.cancel()
        await coord.close()

    run(main())


def test_no_replica_left_fails_naming_why() -> None:
    async def main() -> None:
        coord, members, plan_id = await elastic(n=1)
        coord.disconnected(members[2].worker, "killed")
        await asyncio.sleep(0.25)
        resp = await coord.refit(plan_id, 1, 5)
        assert resp.status == pb.REFIT_STATUS_FAILED
        assert "no whole replica" in resp.error and "e/0 has been gone" in resp.error
        await coord.close()

    run(main())


def test_moe_group_is_rigid() -> None:
    async def main() -> None:
        coord = Coordinator(drop_after=0.0)
        spec = tiny_spec("tiny-qwen3-moe")
        members = [Member(coord, pb.ROLE_TRAINER, "t", 0, "megatron:tp1")]
        members += [Member(coord, pb.ROLE_ENGINE, "e", r, "vllm:tp1dp2") for r in range(2)]
        for m in members:
            m.info.model_name, m.info.model_digest = spec.name, spec.digest()
            m.info.model_config_json = config_json(spec.config)
            await m.register()
        entry, _ = await coord.create_plan("t", "e", pb.PlanOptions())
        assert not entry.dst_shape  # each rank holds other experts: no replica is whole
        coord.disconnected(members[2].worker, "killed")
        await asyncio.sleep(0.05)
        resp = await coord.refit(entry.plan_id, 1, 5)
        assert resp.status == pb.REFIT_STATUS_FAILED and "e/1 not connected" in resp.error
        await coord.close()

    run(main())


def test_engine_view_and_interchangeable() -> None:
    spec = tiny_spec("tiny-qwen2")
    dp3 = resolve_layout("vllm:tp2dp3", spec, Side.ENGINE)
    dp2 = layout_with(dp3, 2, spec)
    assert dp2.describe() == "vllm:tp2dp2"
    assert interchangeable(spec, dp3, 5, dp2, 1) and not interchangeable(spec, dp3, 5, dp2, 2)
    moe = tiny_spec("tiny-qwen3-moe")
    a, b = resolve_layout("vllm:tp1dp2", moe, Side.ENGINE), resolve_layout("vllm:tp1dp4", moe, Side.ENGINE)
    assert a.replicas() is None and not interchangeable(moe, a, 1, b, 1)

    class Row:
        def __init__(self, rank: int, connected: bool = True, left_at: float = 0.0) -> None:
            self.info = pb.WorkerInfo(group="e", rank=rank)
            self.layout, self.layout_str, self.worker_id = dp3, dp3.describe(), f"e/{rank}"
            self.connected, self.left_at = connected, left_at

    now = time.monotonic()
    rows = [Row(r) for r in (0, 1, 2, 3, 4)]  # replica 2 lacks its rank 5
    view = engine_view(rows, spec, 10.0, now=now)
    assert view.replicas == (0, 1) and view.members == ("e/0", "e/1", "e/2", "e/3") and view.left_out == ("e/4",)
    assert {idx: [w.worker_id for w in ws] for idx, ws in view.by_replica().items()} == {0: ["e/0", "e/1"],
                                                                                        1: ["e/2", "e/3"]}
    rows[1] = Row(1, connected=False, left_at=now - 20)
    view = engine_view(rows, spec, 10.0, now=now)
    assert view.replicas == (1,) and view.layout.describe() == "vllm:tp2"
    assert engine_view(rows, spec, None, now=now).replicas == (0, 1)  # never dropped
    assert engine_view(rows, spec, 10.0, only={1}, now=now).members == ("e/2", "e/3")
    with pytest.raises(InvalidInput, match="rank 5 of vllm:tp2dp3 is not registered"):
        engine_view(rows, spec, 10.0, only={2}, now=now)


def test_within_replica_tells_whether_another_replica_could_start_a_refit() -> None:
    spec = tiny_spec("tiny-qwen2")
    dp2 = resolve_layout("vllm:tp2dp2", spec, Side.ENGINE)
    assert within_replica(dp2, 1, "e", ("t/0", "e/0", "e/1"))  # replica 0's own refit
    assert not within_replica(dp2, 1, "e", ("t/0", "e/0", "e/1", "e/2", "e/3"))  # replica 1's leader may start it
    assert within_replica(dp2, 3, "e", ("t/0", "e/2", "e/3", "other/0"))
    tp2 = resolve_layout("vllm:tp2", spec, Side.ENGINE)
    assert within_replica(tp2, 1, "e", ("t/0", "e/0", "e/1"))
