"""The agent's own bookkeeping (refit.control.agent), without a coordinator: which outcomes touch
the version an engine reports."""

from __future__ import annotations

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
