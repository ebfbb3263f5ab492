"""The agent's own bookkeeping (refit.control.agent), without a coordinator: which outcomes touch
the version an engine reports."""

from __future__ import annotations

import asyncio

from refit.control.agent import EngineAgent
from refit.control.dataplane import NoopDataPlane
from refit.control.v1 import refit_pb2 as pb
from tests.harness.tiny import tiny_spec


def engine() -> EngineAgent:
    return EngineAgent("127.0.0.1:1", group="e", rank=0, spec=tiny_spec("tiny-qwen2"), layout="vllm:tp1",
                       data_plane=NoopDataPlane(), version=3)


def test_an_outcome_applies_only_to_the_refit_it_names() -> None:
    a = engine()
    a._last_refit, a._stale = "p-x-2", True  # running refit 2, weights being overwritten
    a._on_outcome(pb.Outcome(refit_id="p-x-1", committed=True, version=4))  # a late commit of refit 1
    assert (a.version, a.stale) == (3, True)
    a._on_outcome(pb.Outcome(refit_id="p-x-2", committed=True, version=5))
    assert (a.version, a.stale) == (5, False)
    a._on_outcome(pb.Outcome(refit_id="p-x-2", committed=False, version=5))  # repeated, as failed
    assert a.stale and a._abandoned == "p-x-2"


def test_registration_reports_the_held_version_and_staleness() -> None:
    a = engine()
    a._stale = True
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
    a._stale_before, a._stale, a._last_refit = ("A", False), True, "A"  # A started here, from fresh weights
    a._on_outcome(pb.Outcome(refit_id="A", committed=False, version=4, untouched=True))
    assert (a.version, a.stale) == (3, False)
    a._stale_before, a._stale, a._last_refit = ("B", False), True, "B"  # B started, then tore the weights
    a._on_outcome(pb.Outcome(refit_id="B", committed=False, version=5))
    assert a.stale
    a._last_refit = "C"  # C answered busy (B's share still runs): never started here
    a._on_outcome(pb.Outcome(refit_id="C", committed=False, version=6, untouched=True))
    assert (a.version, a.stale) == (3, True)
