"""`refit.extension_points`: every extension point is named there as a typed protocol, and what
refit ships (its layouts, planners, data planes, vLLM's landings) and the tests' second engine
(tests/harness/torch_engine.py) have every member of the protocol they implement."""

from __future__ import annotations

import importlib.util

import pytest

from refit import extension_points as ep
from refit.control.dataplane import NoopDataPlane
from refit.control.dataplane_executor import ExecutorDataPlane
from refit.engine import Alone
from refit.layouts import LAYOUTS
from refit.planners import PLANNERS
from tests.harness.torch_engine import TorchLanding


def test_the_four_extension_points_are_declared() -> None:
    assert {"layout", "planner", "data plane", "landing"} <= set(ep.PROTOCOLS)
    assert {"tensors", "nbytes", "stages", "phase_layers", "begin", "check", "landed", "apply"} == \
        ep.members(ep.Landing)
    assert {"open", "prepare", "run", "close"} <= ep.members(ep.DataPlane)
    assert {"plan", "name"} == ep.members(ep.Planner)
    assert {"resolve", "local_tensors", "describe"} <= ep.members(ep.Layout)


def test_what_refit_ships_meets_its_protocols() -> None:
    for cls in LAYOUTS.values():
        assert ep.missing(cls, ep.Layout) == [], cls
    for cls in PLANNERS.values():
        assert ep.missing(cls, ep.Planner) == [], cls
    for cls in (ExecutorDataPlane, NoopDataPlane):
        assert ep.missing(cls, ep.DataPlane) == [], cls
    assert ep.missing(Alone, ep.WorkerGroup) == []
    assert ep.missing(TorchLanding, ep.Landing) == []


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_vllms_landings_meet_the_landing_protocol() -> None:
    from refit.integrations.vllm.compat import VllmWorld
    from refit.integrations.vllm.landing import VllmLanding
    from refit.integrations.vllm.lora_slot import AdapterLanding

    for cls in (VllmLanding, AdapterLanding):
        assert ep.missing(cls, ep.Landing) == [], cls
    assert ep.missing(VllmWorld, ep.WorkerGroup) == []


def test_a_candidate_lacking_members_is_named() -> None:
    class Half:
        tensors: dict = {}

        def begin(self) -> None: ...

    assert ep.missing(Half, ep.Landing) == ["apply", "check", "landed", "nbytes", "phase_layers", "stages"]
