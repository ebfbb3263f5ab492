"""The coordinator's logic (refit.control.coordinator), without processes or gRPC: workers are
registered with a `send` that records what the coordinator tells them, and answer through
`Coordinator.result` as the server's stream handler would (these stand-ins replace the agents;
the control-plane tests run the real ones).

Each test runs its own event loop; refits use short timeouts, so the whole file takes seconds."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import pytest

from refit.control.common import Precondition, config_json
from refit.control.coordinator import Coordinator
from refit.control.registry import Worker
from refit.control.v1 import refit_pb2 as pb
from tests.harness.tiny import tiny_spec

MODEL = "tiny-qwen2"


class Member:
    """A registered worker whose stream is a list: what the coordinator sent it."""

    def __init__(self, coord: Coordinator, role: int, group: str, rank: int, layout: str, version: int = 0) -> None:
        self.coord, self.sent = coord, []
        spec = tiny_spec(MODEL)
        self.info = pb.WorkerInfo(role=role, group=group, rank=rank, host="127.0.0.1", gpu=-1, layout=layout,
                                  model_name=spec.name, model_digest=spec.digest(),
                                  model_config_json=config_json(spec.config), version=version, pid=1000 + rank)
        self.worker: Worker | None = None
        self.runs: asyncio.Queue = asyncio.Queue()

    async def register(self) -> "Member":
        self.worker = await self.coord.register(self.info, self._send, None)
        return self

    async def _send(self, msg: pb.CoordinatorMessage) -> None:
        self.sent.append(msg)
        if msg.WhichOneof("kind") == "run":
            self.runs.put_nowait(msg.run)

    def answer(self, refit_id: str, ok: bool = True, error: str = "") -> None:
        self.coord.result(self.worker, pb.RunResult(refit_id=refit_id, ok=ok, error=error, bytes=10 if ok else 0))

    def outcomes(self) -> list[pb.Outcome]:
        return [m.outcome for m in self.sent if m.WhichOneof("kind") == "outcome"]


async def cluster(trainers: int = 1, engines: int = 1, **kw: Any) -> tuple[Coordinator, list[Member], str]:
    coord = Coordinator(**kw)
    members = [await Member(coord, pb.ROLE_TRAINER, "t", r, f"megatron:tp{trainers}").register() for r in range(trainers)]
    members += [await Member(coord, pb.ROLE_ENGINE, "e", r, f"vllm:tp{engines}").register() for r in range(engines)]
    entry, _ = await coord.create_plan("t", "e", pb.PlanOptions())
    return coord, members, entry.plan_id


def responder(members: list[Member], delay: float = 0.05,
              answer: Callable[[Member, pb.RunRefit], bool | None] = lambda m, r: True) -> asyncio.Task:
    """Answer every run after ``delay``: ``answer`` gives ok (True/False) or None for silence."""
    async def serve(m: Member) -> None:
        while True:
            run = await m.runs.get()
            await asyncio.sleep(delay)
            ok = answer(m, run)
            if ok is not None:
                m.answer(run.refit_id, ok, "" if ok else "TimeoutError: waiting for a peer")

    return asyncio.ensure_future(asyncio.gather(*(serve(m) for m in members)))


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_same_version_twice_at_once_joins_one_run() -> None:
    async def main() -> None:
        coord, members, plan = await cluster()
        task = responder(members, delay=0.2)
        a, b = await asyncio.gather(coord.refit(plan, 1, 5.0), coord.refit(plan, 1, 5.0))
        assert a.status == b.status == pb.REFIT_STATUS_OK and a.refit_id == b.refit_id
        assert [len([m for m in x.sent if m.WhichOneof("kind") == "run"]) for x in members] == [1, 1]
        # Asked again once committed (and still held): the same response, nothing dispatched.
        c = await coord.refit(plan, 1, 5.0)
        assert c.refit_id == a.refit_id and sum(x.runs.qsize() for x in members) == 0
        assert (await coord.refit(plan, 2, 5.0)).status == pb.REFIT_STATUS_OK
        with pytest.raises(Precondition):  # 1 was committed, but the engines moved on
            await coord.refit(plan, 1, 5.0)
        task.cancel()

    run(main())


def test_later_version_waits_for_the_running_one_end_to_end() -> None:
    """v2 is dispatched only after v1 has ended, and v1's commit reaches the engine before v2's run."""
    async def main() -> None:
        coord, members, plan = await cluster()
        task = responder(members, delay=0.2)
        first = asyncio.ensure_future(coord.refit(plan, 1, 5.0))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(coord.refit(plan, 2, 5.0))
        r1, r2 = await asyncio.gather(first, second)
        assert r1.status == r2.status == pb.REFIT_STATUS_OK and r1.refit_id != r2.refit_id
        engine = members[1]
        kinds = [(m.WhichOneof("kind"), m.run.version or m.outcome.version) for m in engine.sent]
        assert kinds == [("run", 1), ("outcome", 1), ("run", 2), ("outcome", 2)], kinds
        assert (engine.worker.version, engine.worker.stale) == (2, False)
        task.cancel()

    run(main())


def test_lower_version_than_the_running_one_is_refused_at_once() -> None:
    async def main() -> None:
        coord, members, plan = await cluster()
        task = responder(members, delay=0.3)
        running = asyncio.ensure_future(coord.refit(plan, 5, 5.0))
        await asyncio.sleep(0.05)
        with pytest.raises(Precondition, match="below 5"):
            await coord.refit(plan, 3, 5.0)
        assert (await running).status == pb.REFIT_STATUS_OK
        task.cancel()

    run(main())


def test_silent_member_is_named_before_peers_reporting_timeouts() -> None:
    """Two members report timeouts at their own deadline; one never answers (SIGSTOPped): the
    refit fails within its timeout, naming the silent one first."""
    async def main() -> None:
        coord, members, plan = await cluster(trainers=2, engines=1)
        silent = members[1]
        runs: list[pb.RunRefit] = []

        async def serve(m: Member) -> None:
            r = await m.runs.get()
            runs.append(r)
            if m is not silent:  # peers give up at the member deadline, as the data plane does
                await asyncio.sleep(r.timeout_seconds)
                m.answer(r.refit_id, False, "TimeoutError: waiting for t/1")

        tasks = [asyncio.ensure_future(serve(m)) for m in members]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        resp = await coord.refit(plan, 1, 1.0)
        assert loop.time() - t0 < 1.3
        assert resp.status == pb.REFIT_STATUS_FAILED
        assert resp.error.split(": ", 1)[1].startswith("t/1 timed out"), resp.error
        outcomes = {w.worker_id: w.outcome for w in resp.workers}
        assert outcomes == {"t/0": pb.WORKER_OUTCOME_ERROR, "t/1": pb.WORKER_OUTCOME_TIMED_OUT,
                            "e/0": pb.WORKER_OUTCOME_ERROR}
        # t/1 stays busy until it answers: the next refit waits for it, then runs.
        assert silent.worker.busy == runs[0].refit_id and not members[0].worker.busy
        task = responder(members, delay=0.01)
        nxt = asyncio.ensure_future(coord.refit(plan, 2, 5.0))
        await asyncio.sleep(0.2)
        assert not nxt.done() and sum(m.runs.qsize() for m in members) == 0
        silent.answer(runs[0].refit_id, False, "Cancelled")  # it wakes up, late
        assert (await nxt).status == pb.REFIT_STATUS_OK
        for t in tasks + [task]:
            t.cancel()

    run(main())


def test_outcome_goes_only_to_its_own_refit_and_ids_differ_across_restarts() -> None:
    async def main() -> None:
        coord, members, plan = await cluster()
        task = responder(members, delay=0.01)
        r1 = await coord.refit(plan, 1, 5.0)
        # A late answer naming an old refit (or another coordinator's) changes nothing.
        members[1].answer("deadbeef-000000-1", True)
        assert (members[1].worker.busy, members[1].worker.version) == ("", 1)
        coord2, members2, plan2 = await cluster()
        task2 = responder(members2, delay=0.01)
        r2 = await coord2.refit(plan2, 1, 5.0)
        assert plan2 == plan and r1.refit_id != r2.refit_id
        for t in (task, task2):
            t.cancel()

    run(main())


def test_joiner_with_a_shorter_timeout_gets_failed_then_joins_again() -> None:
    async def main() -> None:
        coord, members, plan = await cluster()
        task = responder(members, delay=0.5)
        main_call = asyncio.ensure_future(coord.refit(plan, 1, 5.0))
        await asyncio.sleep(0.05)
        short = await coord.refit(plan, 1, 0.1)
        assert short.status == pb.REFIT_STATUS_FAILED and "did not end within the timeout" in short.error
        ok = await main_call
        assert ok.status == pb.REFIT_STATUS_OK and short.refit_id == ok.refit_id
        assert (await coord.refit(plan, 1, 1.0)).refit_id == ok.refit_id
        task.cancel()

    run(main())


def test_disconnected_rows_are_pruned() -> None:
    async def main() -> None:
        from refit.control import coordinator_state as mod

        coord = Coordinator()
        for i in range(mod.MAX_GONE + 50):
            m = await Member(coord, pb.ROLE_TRAINER, f"g{i}", 0, "megatron:tp1").register()
            coord.disconnected(m.worker, "test")
        assert len(coord.workers) == mod.MAX_GONE

    run(main())


def test_a_caller_that_goes_away_does_not_cancel_the_refit() -> None:
    """The first caller's RPC is cancelled (its client died, or gave up) while the members run:
    the refit goes on and ends as it would have — a second caller of the same version gets its
    response, and the engines hear the commit — rather than the joiner being cancelled too and
    the members never told the outcome."""
    async def main() -> None:
        coord, members, plan = await cluster()
        task = responder(members, delay=0.3)
        owner = asyncio.ensure_future(coord.refit(plan, 1, 5.0))
        await asyncio.sleep(0.05)
        joiner = asyncio.ensure_future(coord.refit(plan, 1, 5.0))
        await asyncio.sleep(0.05)
        owner.cancel()
        resp = await joiner
        assert resp.status == pb.REFIT_STATUS_OK, resp.error
        engine = members[1]
        assert [(o.version, o.committed) for o in engine.outcomes()] == [(1, True)]
        assert (engine.worker.version, engine.worker.stale, engine.worker.busy) == (1, False, "")
        task.cancel()

    run(main())


def test_a_failed_refit_whose_caller_went_away_still_rebuilds_and_abandons() -> None:
    """A member fails and its peers hang, and the caller goes away meanwhile: the members are
    still told to abandon the refit and the plan's communicator is still rebuilt (a new rendezvous
    prefix), so the next refit never reuses a group left mid-barrier."""
    async def main() -> None:
        coord, members, plan = await cluster()
        first_prefix: list[str] = []

        def answer(m: Member, r: pb.RunRefit) -> bool | None:
            first_prefix.append(r.rendezvous.prefix)
            return False if m is members[0] else None  # the trainer errs, the engine hangs

        task = responder(members, delay=0.1, answer=answer)
        owner = asyncio.ensure_future(coord.refit(plan, 1, 1.0))
        await asyncio.sleep(0.15)
        owner.cancel()
        await asyncio.sleep(0.5)  # the grace after the failure runs out
        assert [o.committed for o in members[1].outcomes()] == [False]
        assert coord.plans[plan].broken and coord.workers["e/0"].stale
        task.cancel()

    run(main())


def test_a_member_whose_stream_takes_no_message_is_named_within_the_deadline() -> None:
    """A stopped process stops reading its stream; once gRPC's flow-control window is full (a
    first RunRefit carries the plan: megabytes for a large model) the coordinator's write to it
    blocks until keepalive drops the stream.  The refit must still end by its deadline, naming
    that member as timed out, not hang in the dispatch."""
    async def main() -> None:
        coord, members, plan = await cluster(trainers=2, engines=1)
        stuck = members[1]
        never = asyncio.Event()

        async def blocked(msg: pb.CoordinatorMessage) -> None:
            await never.wait()  # the write of a full flow-control window

        stuck.worker.send = blocked

        async def serve(m: Member) -> None:  # peers give up at the barrier the stuck one never reaches
            r = await m.runs.get()
            await asyncio.sleep(r.timeout_seconds)
            m.answer(r.refit_id, False, "TimeoutError: timed out at the refit start barrier; waiting on t/1")

        tasks = [asyncio.ensure_future(serve(m)) for m in members if m is not stuck]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        resp = await asyncio.wait_for(coord.refit(plan, 1, 1.0), 5.0)
        assert loop.time() - t0 < 1.3
        assert resp.status == pb.REFIT_STATUS_FAILED
        assert resp.error.split(": ", 1)[1].startswith("t/1 timed out"), resp.error
        for t in tasks:
            t.cancel()

    run(main())


def test_close_ends_a_refit_waiting_on_silent_members() -> None:
    """The server stops while a refit waits for members that never answer: ``close`` ends it (and
    every send under way) at once, rather than leaving tasks that run on to the refit's timeout;
    its caller is answered FAILED, naming the stop (not cancelled)."""
    async def main() -> None:
        coord, members, plan = await cluster()
        owner = asyncio.ensure_future(coord.refit(plan, 1, 60.0))
        await asyncio.sleep(0.1)
        assert coord._tasks and not owner.done()
        await asyncio.wait_for(coord.close(), 2.0)
        assert not coord._tasks and not coord._runs
        await asyncio.wait((owner,), timeout=1.0)
        resp = owner.result()
        assert resp.status == pb.REFIT_STATUS_FAILED and "the coordinator stopped before it ended" in resp.error

    run(main())


def test_a_plan_hash_given_as_a_plan_id_is_told_which_id_to_use() -> None:
    """`refit plan` prints the plan's content hash; `Refit` takes the id `CreatePlan` returned.
    Pasting the one for the other answered a bare NotFound: now the message names the plan id."""
    from refit.control.common import NotFound

    async def main() -> None:
        coord, _, plan_id = await cluster()
        plan_hash = coord.plans[plan_id].plan.plan_hash
        assert plan_hash != plan_id
        with pytest.raises(NotFound, match=f"is a plan hash .* not a plan id: Refit takes the plan_id that "
                                           f"CreatePlan returned \\({plan_id}\\)"):
            await coord.refit(plan_hash, 1, 1.0)
        with pytest.raises(NotFound, match="unknown plan 'nope'"):
            coord.get_plan("nope")

    run(main())
