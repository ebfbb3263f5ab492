"""refit's extension points, in one place: what to implement to add a planner, a data plane, an
engine or a framework's layout, each a typed protocol with its contract, and where it plugs in.

Each protocol is defined beside the code that calls it (so that module reads whole); this module
names them together, states what an implementation must guarantee, and checks a candidate
(`missing`).  It imports the control plane and the engine side, so nothing in refit imports it.

* **Layout** (`refit.layouts.base.Layout`; register with `refit.layouts.register_layout`): how a
  framework splits a model over its ranks.  ``resolve(spec)`` fills the degrees the framework
  derives and refuses (RefitError, with the numbers) a split the model does not allow;
  ``local_tensors(spec, rank)`` lists the rank's tensors under the framework's own names, each
  with the canonical boxes (pieces) it holds; ``describe()`` parses back to the same layout.
  Elements no piece covers are padding and hold zeros.
* **Planner** (`refit.planners.base.Planner`; register with `refit.planners.register_planner`):
  ``plan(spec, src, dst, placement, bucket_bytes)`` makes every element of every destination
  piece arrive exactly once, from a source rank holding the same canonical element, and depends
  on nothing but its arguments (the plan id is a hash of its output).  Pure: no torch, no I/O.
* **Data plane** (`refit.control.dataplane.DataPlane`, defaults in `BaseDataPlane`; given to an
  agent as ``data_plane=``): moves one agent's share of a refit.  ``open(seat)`` once, ``prepare``
  each plan once (may refuse it before any byte moves), ``run(plan, tensors, ctx)`` per refit:
  returns by ``ctx.deadline``, raises on any failure, writes nothing once ``ctx.cancelled`` is set,
  calls ``ctx.phase_hook.landed`` as each phase landed on every member.
* **Landing** (`refit.engine.landing.Landing`, with `refit.engine.landing.WorkerGroup` for an
  engine of several workers; run by `refit.engine.host.HostRefit` from the engine's own loop):
  what an engine's worker does with a refit's bytes.  ``tensors`` are written only inside a refit
  the worker expects; ``apply`` runs after the commit, between the engine's steps; ``stages``
  says whether a failed refit leaves the live weights untouched (and atomic refits are taken).
  vLLM's is `refit.integrations.vllm.landing`; a plain module's is tests/harness/torch_engine.py.
* **Phase hook** (`refit.control.dataplane.PhaseHook`): a phased landing's ``check`` / ``landed``.
"""

from __future__ import annotations

from typing import Any

from refit.control.dataplane import BaseDataPlane, DataPlane, PhaseHook
from refit.engine.host import HostRefit
from refit.engine.landing import Landing, WorkerGroup
from refit.layouts import register_layout
from refit.layouts.base import Layout
from refit.planners import register_planner
from refit.planners.base import Planner
from refit.protocols import members, missing

__all__ = ["BaseDataPlane", "DataPlane", "HostRefit", "Landing", "Layout", "PhaseHook", "Planner", "WorkerGroup",
           "members", "missing", "register_layout", "register_planner", "PROTOCOLS"]

# name -> protocol, as the docstring lists them
PROTOCOLS: dict[str, Any] = {"layout": Layout, "planner": Planner, "data plane": DataPlane, "landing": Landing,
                             "worker group": WorkerGroup, "phase hook": PhaseHook}
