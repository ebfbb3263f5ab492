"""The agent's own bookkeeping (refit.control.agent), without a coordinator: which outcomes touch
the version an engine reports.  Then its host's side (`Agent.expecting`, `Agent.outcome`,
`Agent.wait_idle`, refit.control.agent_state) with a coordinator on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any, Iterator

import pytest

from refit.control.agent import EngineAgent, TrainerAgent
from refit.control.agent_state import Outcome, Outcomes
from refit.control.dataplane import BaseDataPlane, NoopDataPlane, RunContext
from refit.control.v1 import refit_pb2 as pb
from refit.errors import InvalidInput
from refit.sides import Side
from tests.harness.tiny import tiny_spec


def engine() -> EngineAgent:
    return EngineAgent("127.0.0.1:1", group="e", rank=0, spec=tiny_spec("tiny-qwen2"), layout="vllm:tp1",
                       data_plane=NoopDataPlane(), version=3)


def test_an_outcome_applies_only_to_the_refit_it_names() -> None:
    a = engine()
    a._last_refit, a.holding.stale = "p-x-2", True  # running refit 2, weights being overwritten
    a._on_outcome(pb.Outcome(refit_id="p-x-1", committed=True, version=4))  # a late commit of refit 1
    assert (a.version, a.stale) == (3, True)
    a._on_outcome(pb.Outcome(refit_id="p-x-2", committed=True, version=5))
    assert (a.version, a.stale) == (5, False)
    a._on_outcome(pb.Outcome(refit_id="p-x-2", committed=False, version=5))  # repeated, as failed
    assert a.stale and a._abandoned == "p-x-2"


def test_registration_reports_the_held_version_and_staleness() -> None:
    a = engine()
    a.holding.stale = True
    info = a._info()
    assert (info.version, info.stale, info.role) == (3, True, pb.ROLE_ENGINE)


def queued_run(stream_ends: bool) -> list[str]:
    """A share abandoned with the last stream still runs when a new stream sends a run: the run
    waits for it.  Which runs start once it ends, if that stream ``stream_ends`` meanwhile?"""
    async def main() -> list[str]:
        a = engine()
        started: list[str] = []

        async def start(run: pb.RunRefit, deadline: float) -> None:
            started.append(run.refit_id)

        a._start = start  # type: ignore[method-assign]
        a._running, a._job = "p-x-1", asyncio.get_running_loop().create_future()
        await a._on_run(pb.RunRefit(refit_id="p-y-1", timeout_seconds=5.0))
        await asyncio.sleep(0.01)
        if stream_ends:
            a._stream_ended()
        a._running = ""
        a._job.set_result(None)
        await asyncio.sleep(0.05)
        return started

    return asyncio.run(main())


def test_a_run_queued_behind_an_abandoned_share_starts_when_it_ends() -> None:
    assert queued_run(stream_ends=False) == ["p-y-1"]


def test_a_run_queued_behind_an_abandoned_share_is_dropped_with_its_stream() -> None:
    """Its coordinator counted us out when the stream ended: started later, alone, it would only
    hold our thread at its rendezvous until its own timeout."""
    assert queued_run(stream_ends=True) == []


def test_a_refit_that_moved_nothing_leaves_staleness_as_it_was() -> None:
    """An outcome saying a failed refit moved nothing (`Outcome.untouched`) restores what the
    engine held before that refit started here — and changes nothing for a refit this engine
    never started (answered "busy" while an abandoned share still ran): it must not clear the
    staleness an earlier, torn refit left."""
    a = engine()
    a._stale_before, a.holding.stale, a._last_refit = ("A", False), True, "A"  # A started here, from fresh weights
    a._on_outcome(pb.Outcome(refit_id="A", committed=False, version=4, untouched=True))
    assert (a.version, a.stale) == (3, False)
    a._stale_before, a.holding.stale, a._last_refit = ("B", False), True, "B"  # B started, then tore the weights
    a._on_outcome(pb.Outcome(refit_id="B", committed=False, version=5))
    assert a.stale
    a._last_refit = "C"  # C answered busy (B's share still runs): never started here
    a._on_outcome(pb.Outcome(refit_id="C", committed=False, version=6, untouched=True))
    assert (a.version, a.stale) == (3, True)


def test_a_pinned_holding_stays_stale_through_a_commit_until_it_lands() -> None:
    """A host that found its weights torn (vLLM: a landing failed after the commit) pins them
    stale: no outcome clears that, only the host saying a refit landed whole."""
    a = engine()
    a.holding.pin_stale()
    a._last_refit = "p-x-4"
    a._on_outcome(pb.Outcome(refit_id="p-x-4", committed=True, version=4))
    assert (a.version, a.stale) == (4, True)
    a.holding.landed("p-x-4")
    assert (a.version, a.stale, a.holding.landed_refit) == (4, False, "p-x-4")


def test_outcomes_are_remembered_for_the_last_refits() -> None:
    """Every outcome is remembered, also of refits this agent no longer runs (the host may ask
    late), the last `Outcomes.KEEP` of them."""
    a = engine()
    for i in range(Outcomes.KEEP + 1):
        a._on_outcome(pb.Outcome(refit_id=f"r{i}", committed=False, error="e", untouched=True))
    assert a.outcome("r0") is None and a.outcome("r1") == Outcome(committed=False, error="e", untouched=True)
    assert a.outcome(f"r{Outcomes.KEEP}").moved_nothing and (a.version, a.stale) == (3, False)


# ------------------------------------------------------------------------------------------------
# The host's side of an agent (`expecting`, `outcome`, `wait_idle`), through a real coordinator on
# loopback: each wait is woken by what it waits for, across the agents' loop and the host's threads.


class Gated(BaseDataPlane):
    """An engine's share that holds until released (within the refit's time)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def run(self, plan: Any, tensors: Any, ctx: RunContext) -> tuple[int, float]:
        self.entered.set()
        if not self.release.wait(ctx.remaining()):
            raise TimeoutError("never released")
        return 0, 0.0


class Driven(EngineAgent):
    """An engine whose host drives its refits, as vLLM's ``update_weights`` does."""

    expects_refits = True
    EXPECT_GRACE = 0.5


@contextlib.contextmanager
def pair(address: str, name: str, engine_cls: type[EngineAgent] = EngineAgent,
         plane: Any = None) -> Iterator[tuple[TrainerAgent, EngineAgent]]:
    spec = tiny_spec("tiny-qwen2")
    agents = (TrainerAgent(address, group=f"{name}-t", rank=0, spec=spec, layout="megatron:tp1",
                           data_plane=NoopDataPlane()),
              engine_cls(address, group=f"{name}-e", rank=0, spec=spec, layout="vllm:tp1",
                         data_plane=plane or NoopDataPlane()))
    try:
        for a in agents:
            a.start()
        yield agents
    finally:
        for a in agents:
            a.stop()


def refit_in_background(client: Any, plan: str, version: int) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["result"] = client.refit(plan, version, timeout=20.0, check=False)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out["result"] = e

    t = threading.Thread(target=call)
    t.start()
    return t, out


def test_a_refit_not_expected_is_refused_after_the_grace(server) -> None:
    """An agent that expects its refits refuses any other once `EXPECT_GRACE` has passed, before
    any byte moves (its version and staleness stay); so does any agent expecting another one."""
    srv, client = server
    with pair(srv.address, "unexpected", Driven) as (_, engine):
        plan = client.create_plan("unexpected-t", "unexpected-e")["plan_id"]
        t0 = time.monotonic()
        result = client.refit(plan, 1, timeout=20.0, check=False)
        assert not result.ok and f"unexpected-e/0 does not expect a refit of plan {plan} version 1" in result.error
        assert Driven.EXPECT_GRACE <= time.monotonic() - t0 < 5.0
        assert engine.outcome(result.refit_id, 5.0) == Outcome(committed=False, error=result.error, untouched=True)
        assert (engine.version, engine.stale, engine.last_refit) == (0, False, "")
        with engine.expecting(plan, 2):  # another version
            assert not client.refit(plan, 1, timeout=20.0, check=False).ok
        with engine.expecting(plan, 1):
            result = client.refit(plan, 1, timeout=20.0)
        # the outcome is sent before the call returns, not waited for: the agent may hear it after
        assert engine.outcome(result.refit_id, 5.0) == Outcome(committed=True)
        assert (engine.version, engine.stale, engine.last_refit) == (1, False, result.refit_id)
    with pair(srv.address, "plain") as (_, engine):  # any agent: while it expects one, only that one
        plan = client.create_plan("plain-t", "plain-e")["plan_id"]
        engine.EXPECT_GRACE = 0.2
        with engine.expecting(plan, 2):
            assert "does not expect" in client.refit(plan, 1, timeout=20.0, check=False).error
        assert client.refit(plan, 1, timeout=20.0).ok  # expecting none: it runs what it is sent


def test_a_command_waiting_for_its_expectation_wakes_when_it_is_set(server) -> None:
    """A command that arrives a moment before the host expects it (another replica's leader was
    first) runs as soon as the host does, not when the grace ends."""
    srv, client = server
    with pair(srv.address, "early", Driven) as (_, engine):
        engine.EXPECT_GRACE = 10.0
        plan = client.create_plan("early-t", "early-e")["plan_id"]
        thread, out = refit_in_background(client, plan, 1)
        time.sleep(0.3)  # the command waits on the engine's stream
        assert thread.is_alive() and engine.last_refit == ""
        t0 = time.monotonic()
        with engine.expecting(plan, 1):
            thread.join(10.0)
        assert not thread.is_alive() and out["result"].ok, out
        assert time.monotonic() - t0 < 2.0
        assert engine.outcome(out["result"].refit_id, 5.0) == Outcome(committed=True)
        assert (engine.version, engine.last_refit) == (1, out["result"].refit_id)


def test_outcome_and_wait_idle_wake_host_threads(server) -> None:
    """A host thread waiting for a refit's outcome, or for the agent's share to end, wakes when it
    comes (`Outcome`: committed, the error, whether it moved nothing); an outcome never heard is
    None once the wait is over."""
    srv, client = server
    plane = Gated()
    with pair(srv.address, "waits", plane=plane) as (_, engine):
        plan = client.create_plan("waits-t", "waits-e")["plan_id"]
        assert engine.wait_idle(0.0) and engine.outcome("no-such-refit", 0.05) is None
        thread, out = refit_in_background(client, plan, 1)
        assert plane.entered.wait(10.0), "the share never started"
        refit_id = engine.last_refit
        heard: dict[str, Any] = {}
        waiters = [threading.Thread(target=lambda: heard.update(outcome=engine.outcome(refit_id, 10.0))),
                   threading.Thread(target=lambda: heard.update(idle=engine.wait_idle(10.0)))]
        for w in waiters:
            w.start()
        time.sleep(0.2)
        assert not heard and not engine.wait_idle(0.05)  # the share still runs: nothing to hear yet
        t0 = time.monotonic()
        plane.release.set()
        for w in waiters:
            w.join(10.0)
        thread.join(10.0)
        assert time.monotonic() - t0 < 2.0 and out["result"].ok, out
        assert heard == {"outcome": Outcome(committed=True), "idle": True}
        assert engine.outcome(refit_id) == Outcome(committed=True) and not engine.outcome(refit_id).moved_nothing


def test_a_tensor_removed_from_a_mapping_fails_the_refit_naming_it(server) -> None:
    """An agent given its tensors as a mapping, one of them deleted afterwards: the refit fails
    naming that tensor (it was a bare KeyError from the data plane)."""
    import torch

    from refit.layouts import resolve_layout

    srv, client = server
    spec = tiny_spec("tiny-qwen2")
    layout = resolve_layout("megatron:tp1", spec, Side.TRAINER)
    gen = torch.Generator().manual_seed(0)
    tensors = {lt.name: torch.randn(lt.shape, generator=gen).to(getattr(torch, lt.dtype))
               for lt in layout.local_tensors(spec, 0)}
    trainer = TrainerAgent(srv.address, group="mapped-t", rank=0, spec=spec, layout=layout, tensors=tensors)
    engine = EngineAgent(srv.address, group="mapped-e", rank=0, spec=spec, layout="vllm:tp1", data_plane=NoopDataPlane())
    try:
        trainer.start(), engine.start()
        plan = client.create_plan("mapped-t", "mapped-e")["plan_id"]
        gone = sorted(tensors)[0]
        del tensors[gone]
        result = client.refit(plan, 1, timeout=20.0, check=False)
        assert not result.ok and f"mapped-t/0: tensor {gone!r} (1 in all) was removed" in result.error, result.error
    finally:
        trainer.stop(), engine.stop()


def test_a_data_plane_lacking_a_declared_member_is_refused_naming_it() -> None:
    class Bare:  # the four calls, none of the declared capabilities
        def open(self, seat: Any) -> None: ...
        def prepare(self, plan: Any, rank: Any = None) -> None: ...
        def run(self, plan: Any, tensors: Any, ctx: Any) -> tuple[int, float]: return 0, 0.0
        def close(self) -> None: ...

    with pytest.raises(InvalidInput, match=r"data_plane Bare lacks checksums, delta_fallback, inline, last_delta, "
                                           r"reports_start, verifies \(refit.control.dataplane.DataPlane; subclass "
                                           r"BaseDataPlane"):
        EngineAgent("127.0.0.1:1", group="e", rank=0, spec=tiny_spec("tiny-qwen2"), layout="vllm:tp1", data_plane=Bare())
