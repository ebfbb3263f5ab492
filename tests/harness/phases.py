"""Phased refits (`refit.phases`) in tests: what an engine must hold while a phased refit is half
way (the canonical rows of the phases landed so far hold the new version, the rest still the old
one), a `PhaseHook` that checks it as each phase lands, and agents in processes of their own."""

from __future__ import annotations

from typing import Any

import torch

from refit.control.agent import EngineAgent, TrainerAgent
from refit.errors import RefitError
from refit.layouts import Layout, resolve_layout
from refit.phases import phase_key
from refit.plan import Plan
from refit.regions import slices
from refit.sides import Side
from refit.spec import ModelSpec
from tests.harness.control_cluster import CTX, DST, MODEL, SRC, canonical, fill
from tests.harness.procs import PipedProcess
from tests.harness.tiny import tiny_spec


def mixed_canonical(spec: ModelSpec, old: int, new: int, plan: Plan, landed: int) -> dict[str, torch.Tensor]:
    """Canonical tensors holding version ``new`` in every row of a phase keyed ``<= landed`` and
    version ``old`` elsewhere (`landed` = the last phase key landed)."""
    before, after = canonical(spec, old), canonical(spec, new)
    out = {}
    for t in spec.tensors:
        rows = range(len(t.layers)) if t.layers else [0]
        done = torch.tensor([phase_key(spec, t.name, r, plan.phase_layers) <= landed for r in rows])
        if not t.layers:
            out[t.name] = after[t.name] if done.item() else before[t.name]
            continue
        mask = done.view((-1,) + (1,) * (len(t.shape) - 1))
        out[t.name] = torch.where(mask, after[t.name], before[t.name])
    return out


def rank_tensors(spec: ModelSpec, layout: Layout, rank: int, canon: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rank's local tensors filled from ``canon`` through the layout's pieces (padding 0)."""
    out = {}
    for lt in layout.local_tensors(spec, rank):
        t = out[lt.name] = torch.zeros(lt.shape, dtype=torch.bfloat16)
        for p in lt.pieces:
            t.view(lt.view_shape(len(spec[p.tensor].shape)))[slices(p.local_start, p.size)] = \
                canon[p.tensor][slices(p.start, p.size)]
    return out


def differing(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Names of the local tensors that differ bit for bit."""
    return [n for n in want if not torch.equal(want[n].view(torch.int16), got[n].view(torch.int16))]


# ------------------------------------------------------------------ agents in processes of their own


class RecordingHook:
    """A `refit.control.dataplane.PhaseHook` that records, as each phase lands, which local
    tensors do not hold exactly the expected mix of versions ``old``/``new`` (set before a refit);
    ``refuse`` makes `check` refuse the plan, ``fail_at`` makes landing that phase raise."""

    def __init__(self, spec: ModelSpec, layout: Layout, rank: int, tensors: dict[str, torch.Tensor]) -> None:
        self.spec, self.layout, self.rank, self.tensors = spec, layout, rank, tensors
        self.old, self.new, self.refuse = 0, 1, False
        self.fail_at: int | None = None
        self.checked: list[str] = []
        self.calls: list[tuple[int, list[str]]] = []

    def check(self, plan: Plan) -> None:
        self.checked.append(plan.plan_hash)
        if self.refuse:
            raise RefitError(f"this engine cannot land plan {plan.plan_hash} in phases of {plan.phase_layers} layers")

    def landed(self, plan: Plan, phase: int) -> None:
        mixed = mixed_canonical(self.spec, self.old, self.new, plan, phase)
        self.calls.append((phase, differing(rank_tensors(self.spec, self.layout, self.rank, mixed), self.tensors)))
        if phase == self.fail_at:
            raise RuntimeError(f"applying phase {phase} failed")


def agent_main(conn: Any, address: str, role: str, rank: int, phase_layers: int) -> None:
    """A trainer or engine agent (tiny Qwen3-MoE, CPU gloo) driven through ``conn``."""
    spec = tiny_spec(MODEL)
    layout = resolve_layout(SRC if role == "trainer" else DST, spec, Side.named(role))
    tensors = fill(spec, layout, rank, 0)
    hook = RecordingHook(spec, layout, rank, tensors) if role == "engine" else None
    cls = TrainerAgent if role == "trainer" else EngineAgent
    agent = cls(address, group=role, rank=rank, spec=spec, layout=layout, tensors=tensors,
                phase_layers=phase_layers, phase_hook=hook).start()
    conn.send(("ready", None))
    while True:
        cmd, arg = conn.recv()
        if cmd == "fill":
            fill(spec, layout, rank, arg, tensors)
            conn.send(("ok", None))
        elif cmd == "versions":  # what the hook expects: (old, new)
            assert hook is not None
            hook.old, hook.new = arg
            hook.calls.clear()
            conn.send(("ok", None))
        elif cmd == "calls":
            conn.send(("ok", hook.calls if hook else []))
        elif cmd == "check":
            conn.send(("ok", differing(fill(spec, layout, rank, arg), tensors)))
        else:
            agent.stop()
            conn.send(("ok", None))
            return


class AgentProcess(PipedProcess):
    """A spawned `agent_main` and the pipe that drives it."""

    def __init__(self, address: str, role: str, rank: int, phase_layers: int = 0) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=agent_main, args=(child, address, role, rank, phase_layers), daemon=True)
        self.proc.start()

    def ask(self, cmd: str, arg: Any = None, timeout: float = 60.0) -> Any:
        if cmd != "ready":
            self.conn.send((cmd, arg))
        assert self.conn.poll(timeout), f"no answer to {cmd}"
        status, value = self.conn.recv()
        assert status in ("ok", "ready"), (status, value)
        return value

