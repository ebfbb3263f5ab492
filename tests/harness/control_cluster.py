"""Worker processes for the control-plane tests: real trainer and engine agents (multiprocessing
spawn) over the CPU gloo transport, driven from the test through a pipe.

Weights are a pure function of (canonical element, version): every element of every canonical
tensor gets a pseudo-random bf16 value hashed from its global index and the version, and a rank's
local tensors are filled from those through the layout's pieces (padding stays 0), as tests/harness/sim.py
does with ids.  An engine can then check, bit for bit, that it holds exactly version v.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Union

import torch

from refit.control.agent import EngineAgent, TrainerAgent
from refit.control.dataplane_executor import ExecutorDataPlane
from refit.layouts import Layout, resolve_layout
from refit.plan import Plan
from refit.regions import slices
from refit.sides import Side
from refit.spec import ModelSpec
from tests.harness.tiny import tiny_spec
from tests.harness.procs import AfterFirstPhase, PipedProcess, strike_self, warm_context

CTX = warm_context()  # its processes fork from a server that imported torch once
MODEL, SRC, DST = "tiny-qwen3-moe", "megatron:tp2ep2", "vllm:tp2"


Version = Union[int, tuple[int, int, float]]  # or (version, base, fraction): see `canonical`


def canonical(spec: ModelSpec, version: Version) -> dict[str, torch.Tensor]:
    """Every tensor's values at ``version``.  ``(version, base, fraction)``: ``base``'s values with
    about ``fraction`` of the elements at ``version``'s instead (a small step: delta refits)."""
    if isinstance(version, tuple):
        v, old, fraction = version
        new, before = canonical(spec, v), canonical(spec, old)
        out = {}
        for i, name in enumerate(new):
            pick = torch.rand(new[name].shape, generator=torch.Generator().manual_seed(v * 1000003 + i)) < fraction
            out[name] = torch.where(pick, new[name], before[name])
        return out
    out, base = {}, 0
    for t in spec.tensors:
        ids = torch.arange(base, base + t.numel, dtype=torch.int64)
        base += t.numel
        x = (ids * 2654435761 + version * 40503 + 12345) % (1 << 31)
        x = (x ^ (x >> 15)) * 2246822519 % (1 << 31)
        out[t.name] = ((x >> 7).to(torch.float32) / float(1 << 24) - 0.5).to(torch.bfloat16).reshape(t.shape)
    return out


def fill(spec: ModelSpec, layout: Layout, rank: int, version: Version, tensors: dict[str, torch.Tensor] | None = None
         ) -> dict[str, torch.Tensor]:
    """A rank's local tensors holding ``version`` (in place when ``tensors`` is given)."""
    canon = canonical(spec, version)
    out = tensors if tensors is not None else {}
    for lt in layout.local_tensors(spec, rank):
        t = out.setdefault(lt.name, torch.zeros(lt.shape, dtype=torch.bfloat16))
        t.zero_()
        for p in lt.pieces:
            t.view(lt.view_shape(len(spec[p.tensor].shape)))[slices(p.local_start, p.size)] = \
                canon[p.tensor][slices(p.start, p.size)]
    return out


class HookedDataPlane(ExecutorDataPlane):
    """The executor data plane (gloo on CPU) with test hooks for a given version's share: sleep
    before it starts (``delays``: a fault at the start barrier), or strike once its first phase
    landed on every member (``faults``: an `AfterFirstPhase` action — bytes of the refit have
    landed, the refit is not over), or once its whole share ran, before it answers (``after``:
    "kill" — every member passed the end barrier, so every engine holds the version, staged or
    live — or ``("corrupt", local name)``: flip one bit of that received tensor, as a wire fault
    would, before the share's checksums are taken).  Each sets ``entered``."""

    def __init__(self, entered: Any) -> None:
        super().__init__()
        self.delays: dict[int, float] = {}
        self.faults: dict[int, str] = {}
        self.after: dict[int, Any] = {}
        self.entered = entered

    def run(self, plan, tensors, ctx):  # type: ignore[no-untyped-def]
        delay = self.delays.pop(ctx.version, 0.0)
        fault = self.faults.pop(ctx.version, None)
        after = self.after.pop(ctx.version, None)
        if fault:
            ctx.phase_hook = AfterFirstPhase(ctx.phase_hook, self.entered, fault)
        if delay:
            self.entered.set()
            time.sleep(delay)
        out = super().run(plan, tensors, ctx)
        if after == "kill":
            self.entered.set()
            strike_self(signal.SIGKILL)
        elif after is not None:
            _, name = after
            tensors[name].view(torch.uint8).view(-1)[0] ^= 1
            self.entered.set()
        return out


def worker_main(conn: Any, entered: Any, address: str, role: str, group: str, rank: int, layout: str,
                version: int, phase_layers: int = 0, model: str = MODEL) -> None:
    spec = tiny_spec(model)
    lay = resolve_layout(layout, spec, Side.named(role))
    tensors = fill(spec, lay, rank, version)
    dp = HookedDataPlane(entered)
    cls = TrainerAgent if role == "trainer" else EngineAgent
    agent = cls(address, group=group, rank=rank, spec=spec, layout=lay, tensors=tensors, data_plane=dp,
                version=version if role == "engine" else 0, phase_layers=phase_layers).start()
    conn.send(("ready", os.getpid()))
    while True:
        cmd, arg = conn.recv()
        if cmd == "fill":
            fill(spec, lay, rank, arg, tensors)
            conn.send(("ok", None))
        elif cmd == "check":  # number of local tensors that differ from `arg`'s, bit for bit
            want = fill(spec, lay, rank, arg)
            bad = [n for n in want if not torch.equal(want[n].view(torch.int16), tensors[n].view(torch.int16))]
            conn.send(("ok", bad))
        elif cmd == "mixed":  # local tensors that differ from the mix (old, new) of a phased refit half way
            from tests.harness.phases import differing, mixed_canonical, rank_tensors

            old, new, plan, landed = arg
            mixed = mixed_canonical(spec, old, new, Plan.from_dict(plan), landed)
            conn.send(("ok", differing(rank_tensors(spec, lay, rank, mixed), tensors)))
        elif cmd == "delay":
            dp.delays[arg[0]] = arg[1]
            entered.clear()
            conn.send(("ok", None))
        elif cmd == "fault":  # (version, AfterFirstPhase action)
            dp.faults[arg[0]] = arg[1]
            entered.clear()
            conn.send(("ok", None))
        elif cmd == "after":  # (version, "kill" or ("corrupt", local name))
            dp.after[arg[0]] = arg[1]
            entered.clear()
            conn.send(("ok", None))
        elif cmd == "corrupt":  # flip one bit of a local tensor, as memory going bad would
            tensors[arg].view(torch.uint8).view(-1)[0] ^= 1
            conn.send(("ok", None))
        elif cmd == "state":
            conn.send(("ok", (agent.version, agent.stale, agent.connected)))
        elif cmd == "disconnect":
            agent.stop()
            conn.send(("ok", None))
        elif cmd == "reconnect":
            agent.start()
            conn.send(("ok", None))
        elif cmd == "stop":
            agent.stop()
            conn.send(("ok", None))
            return


class Worker(PipedProcess):
    """A spawned agent process and the pipe that drives it."""

    def __init__(self, address: str, role: str, group: str, rank: int, layout: str, version: int = 0,
                 phase_layers: int = 0, model: str = MODEL) -> None:
        self.role, self.group, self.rank, self.phase_layers, self.model = role, group, rank, phase_layers, model
        self.conn, child = CTX.Pipe()
        self.entered = CTX.Event()
        self.proc = CTX.Process(target=worker_main, daemon=True, args=(child, self.entered, address, role, group, rank,
                                                                       layout, version, phase_layers, model))
        self.proc.start()

    @property
    def worker_id(self) -> str:
        return f"{self.group}/{self.rank}"

    def ready(self, timeout: float = 60.0) -> None:
        assert self.conn.poll(timeout), f"{self.worker_id} did not start"
        assert self.conn.recv()[0] == "ready"

    def ask(self, cmd: str, arg: Any = None, timeout: float = 30.0) -> Any:
        self.conn.send((cmd, arg))
        assert self.conn.poll(timeout), f"{self.worker_id}: no answer to {cmd}"
        status, value = self.conn.recv()
        assert status == "ok"
        return value

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

