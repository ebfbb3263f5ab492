"""Worker agents: the control-plane end inside a trainer rank or an engine rank.

An agent registers its rank with the coordinator over one long-lived stream, then runs its share
of every refit it is told to run, through a pluggable data plane (`refit.control.dataplane`):

    agent = TrainerAgent("127.0.0.1:50051", group="trainer", rank=r, spec=spec,
                         layout="megatron:tp4ep8", tensors=lambda: local_tensors(model)).start()

``tensors``: the rank's local tensors, or a callable read at every refit that follows the model
(`refit.control.dataplane.TensorSource`).  The streams of all agents of a process live on one
background thread and asyncio loop, so the host process (a training loop, a vLLM worker) is never
blocked by the control plane; each agent's data plane runs on a thread of its own (one refit at a
time: a command while one still runs is answered "busy": a stale share never overwrites a newer one).
An `EngineAgent` knows the version of the weights it holds (`Holding`): stale from the moment a
refit starts writing until the coordinator says it was committed.

A host that drives its own refits (vLLM's ``update_weights``) announces each one (`Agent.expecting`):
the agent then runs no other, and the host waits for its outcome (`Agent.outcome`) and for the
agent's share to end (`Agent.wait_idle`), each woken when it happens (`refit.control.agent_state`).

Agents stay connected by themselves, reconnecting when the stream drops
(`refit.control.agent_stream`, the connection half of an agent).  What runs a share — the plan
fetched and prepared, the rank's tensors, an atomic refit's staging and switch — is
`refit.control.agent_share`, the data-plane half; this module decides which commands run, and
what their outcomes make of the weights the agent holds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, ClassVar, Iterator

import torch

from refit.control.agent_share import AgentShare
from refit.control.agent_state import Expectation, Holding, Outcome, Outcomes
from refit.control.common import (KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS, config_json, coordinator_address,
                                  coordinator_token, on_agent_loop, role_of, worker_id)
from refit.control.dataplane import DataPlane, PhaseHook, Rendezvous, RunContext, Seat, Tensors, TensorSource, check_data_plane
from refit.control.store_client import CoordinatorStore
from refit.control.v1 import refit_pb2 as pb
from refit.errors import InvalidInput
from refit.layouts import Layout, resolve_layout
from refit.plan import Plan
from refit.sides import Side
from refit.spec import ModelSpec
from refit.timeline import mark

log = logging.getLogger(__name__)


class Agent(AgentShare):
    """One worker rank's end of the control plane: runs its share of the refits the coordinator
    sends over its stream (`AgentStream`) through its data plane (`AgentShare`), and tells its host
    how they ended."""

    role: ClassVar[Side]
    # Whether the tensors this agent is given are the weights it serves (a Check reads them);
    # False where they are a staging the host re-processes from (vLLM on CPU, quantized layers).
    serves_its_tensors: bool = True
    # True: run only the refit announced with `expecting` (a host that drives its refits itself);
    # else any the coordinator sends, unless the host announced one.
    expects_refits: ClassVar[bool] = False
    # Seconds a command may wait for its announcement: it can arrive a moment before the host
    # announces it (another replica's leader started the refit first).
    EXPECT_GRACE: ClassVar[float] = 10.0

    def __init__(self, address: str | None = None, *, group: str, rank: int, spec: ModelSpec, layout: str | Layout,
                 tensors: TensorSource | None = None, data_plane: DataPlane | None = None,
                 host: str = "127.0.0.1", gpu: int = -1, token: str | None = None, version: int = 0,
                 reconnect: bool = True, backoff: tuple[float, float] = (0.1, 5.0),
                 keepalive_ms: int = KEEPALIVE_MS, keepalive_timeout_ms: int = KEEPALIVE_TIMEOUT_MS,
                 phase_layers: int = 0, phase_hook: PhaseHook | None = None, holding: Holding | None = None,
                 stages: bool = True) -> None:
        """``address``, ``token``: the coordinator's (default ``$REFIT_ADDRESS``, else
        127.0.0.1:50051, and ``$REFIT_TOKEN``).  ``tensors``: this rank's local tensors by local
        name, or a callable returning them at every refit (`TensorSource`); ``None``: none, for
        data planes that need none (tests, benches).  ``data_plane`` defaults to `refit.executor`
        (gloo on CPU, CUDA IPC / NCCL on GPUs).
        ``reconnect``: register again by itself when the stream drops, waiting between tries from
        ``backoff[0]`` doubling up to ``backoff[1]`` seconds.  ``keepalive_ms``: ping interval
        (the coordinator's own must not be above it; tests shorten both).  ``phase_layers`` (engines):
        plans into this group are cut into phases of that many layers (`refit.phases`; 0: not
        phased); ``phase_hook`` checks each plan before it runs and hears each phase land.
        ``holding``: what the weights are, carried over from an earlier agent of the same weights
        (registered again); by default a new record at ``version``.  ``stages`` (engines): under
        an atomic refit, receive into staging and switch the tensors only at the commit
        (`_staging`, `_switch`); False: this engine cannot, and atomic refits refuse it."""
        super().__init__(coordinator_address(address), coordinator_token(token), reconnect=reconnect,
                         backoff=backoff, keepalive_ms=keepalive_ms, keepalive_timeout_ms=keepalive_timeout_ms)
        self.group, self.rank, self.spec = group, rank, spec
        self.layout = resolve_layout(layout, spec, self.role) if isinstance(layout, str) else layout.resolve(spec)
        if not 0 <= rank < self.layout.world_size:
            raise InvalidInput(f"rank {rank} is outside {self.layout.describe()} (world size {self.layout.world_size})")
        self._source: TensorSource = tensors if tensors is not None else {}
        self._names = frozenset(lt.name for lt in self.layout.local_tensors(spec, rank)) if tensors is not None \
            else frozenset()  # what a mapping given as tensors must keep holding
        if tensors is not None:
            self._read_tensors()  # a wrong tensor is refused before registering
        if data_plane is None:
            from refit.control.dataplane_executor import ExecutorDataPlane

            data_plane = ExecutorDataPlane()
        else:
            check_data_plane(data_plane)
        self.host, self.gpu = host, gpu
        data_plane.open(Seat(self.role, rank, spec, self.layout, host))  # bound once: who it moves bytes for
        self.data_plane: DataPlane = data_plane
        if phase_layers < 0:
            raise InvalidInput(f"phase_layers must be >= 0, got {phase_layers}")
        self.phase_layers, self.phase_hook = phase_layers, phase_hook
        self.holding = holding if holding is not None else Holding(version)
        self.stages = stages and self.role is Side.ENGINE
        self._stage_buffers: dict[str, torch.Tensor] = {}  # an atomic refit's staging, kept for the next
        self._staging_current = False  # the staging holds what live holds (set by a switch)
        self._staged: tuple[str, int, Tensors, Tensors] | None = None  # (refit id, version, staged, live)
        self._switch_task: asyncio.Future | None = None
        self._stale_before: tuple[str, bool] = ("", False)  # (refit id, staleness before it started here)
        self._running = ""  # refit id whose share runs on our thread
        self._last_refit = ""  # the refit we were last told to run: outcomes of others are ignored
        self._abandoned = ""  # the last refit the coordinator told us to abandon
        self._waiting: asyncio.Future | None = None  # a run queued behind an abandoned share
        self._idle = threading.Condition()  # notified as a share (or a run queued) ends
        self._expected = Expectation()
        self._outcomes = Outcomes()
        self._plans: dict[str, Plan] = {}
        self._plays: dict[str, int] = {}  # plan hash -> the rank this worker last played in it (`_play`)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"refit-{self.worker_id}")
        self._job: asyncio.Future | None = None
        self._cancel: dict[str, threading.Event] = {}
        self._members: dict[str, tuple[str, ...]] = {}

    # ------------------------------------------------------------------ public
    @property
    def worker_id(self) -> str:
        return worker_id(self.group, self.rank)

    @property
    def version(self) -> int:
        """The version of the weights this worker holds (engines; trainers report 0)."""
        return self.holding.version

    @property
    def stale(self) -> bool:
        return self.holding.stale

    @property
    def last_refit(self) -> str:
        """The refit this agent was last told to run ("" before any)."""
        return self._last_refit

    @contextlib.contextmanager
    def expecting(self, plan_id: str, version: int) -> Iterator[None]:
        """Run only refit ``(plan_id, version)`` inside this block: another command waits up to
        `EXPECT_GRACE` for its own announcement, then is refused (`refusal`) before any byte moves."""
        self._expected.set((plan_id, int(version)))
        try:
            yield
        finally:
            self._expected.set(None)

    def expect_grace(self, run: pb.RunRefit) -> float:
        """How long a command this agent does not expect yet may wait for its announcement."""
        return self.EXPECT_GRACE

    def refusal(self, plan_id: str, version: int) -> str:
        """The error a refused command is answered with."""
        return f"{self.worker_id} does not expect a refit of plan {plan_id} version {version}"

    def outcome(self, refit_id: str, timeout: float = 0.0) -> Outcome | None:
        """How refit ``refit_id`` ended, as the coordinator told this agent, waiting up to
        ``timeout`` seconds for it; None if it did not (or long ago: the last `Outcomes.KEEP` are kept)."""
        return self._outcomes.wait(refit_id, timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Whether this agent's data plane runs no share (any more, nor one queued behind an
        abandoned share) within ``timeout`` seconds."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._running and not self._queued(), timeout)

    def _queued(self) -> bool:
        return self._waiting is not None and not self._waiting.done()

    def _share_ended(self, *_: Any) -> None:
        with self._idle:
            self._idle.notify_all()

    # ------------------------------------------------------------------ stream (AgentStream's hooks)
    def _stopped(self) -> None:
        """Close the data plane (its communicators, maps of peers' memory) on the share thread,
        after a share still running has ended."""
        try:
            done = self._pool.submit(self.data_plane.close)
        except RuntimeError:  # the interpreter is exiting: nothing to give back
            return
        concurrent.futures.wait((done,), timeout=0 if on_agent_loop() else 10)

    def _info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(role=role_of(self.role), group=self.group, rank=self.rank, host=self.host, gpu=self.gpu,
                             layout=self.layout.describe(), model_name=self.spec.name, model_digest=self.spec.digest(),
                             model_config_json=config_json(self.spec.config), version=self.holding.version,
                             stale=self.holding.stale, pid=os.getpid(), phase_layers=self.phase_layers,
                             stages=self.stages, takes_delta=self.role is Side.ENGINE and self.serves_its_tensors)

    def _stream_ended(self) -> None:
        """A share still running is abandoned (a later run waits for it to end); a run queued behind
        it came on this stream, whose coordinator counts us out already: it must not start later,
        alone, and hold our thread until its own timeout."""
        super()._stream_ended()
        for ev in self._cancel.values():
            ev.set()
        if self._waiting is not None:
            self._waiting.cancel()
            self._waiting = None

    # ------------------------------------------------------------------ refits
    async def _on_run(self, run: pb.RunRefit) -> None:
        mark(f"{self.role.value}: RunRefit received")
        if run.rendezvous.members:  # names come once per prefix (`expect_grace` may read them)
            self._members = {run.rendezvous.prefix: tuple(run.rendezvous.members)}
        if (self.expects_refits or self._expected.value is not None) and not run.check_only:  # a check writes nothing
            # The stream reader waits too: nothing else is due on it before this worker answers.
            grace = min(self.expect_grace(run), run.timeout_seconds)
            if not await self._expected.until((run.plan_id, run.version), grace):
                log.warning("%s: refusing refit %s (plan %s version %d): expecting %s", self.worker_id, run.refit_id,
                            run.plan_id, run.version, self._expected.value)
                await self._reply(run.refit_id, False, error=self.refusal(run.plan_id, run.version))
                return
        deadline = time.monotonic() + run.timeout_seconds
        self._last_refit = run.refit_id
        if self._running:
            # A share abandoned with our last stream (the coordinator restarted, the network broke)
            # still has to end: wait for it within this run's time, rather than answer "busy" to a
            # coordinator that cannot know about it.  Reading the stream goes on meanwhile.
            self._waiting = asyncio.ensure_future(self._after_previous(run, deadline))
            self._waiting.add_done_callback(self._share_ended)
            return
        await self._start(run, deadline)

    async def _after_previous(self, run: pb.RunRefit, deadline: float) -> None:
        try:
            if self._job is not None:
                await asyncio.wait((self._job,), timeout=max(0.0, deadline - time.monotonic()))
            if self._running:
                await self._reply(run.refit_id, False, error=f"busy: still running refit {self._running}")
                return
            await self._start(run, deadline)
        except Exception as e:  # the stream is gone; the coordinator already counts us out
            log.info("%s: could not run refit %s: %s", self.worker_id, run.refit_id, e)

    async def _start(self, run: pb.RunRefit, deadline: float) -> None:
        if self.role is Side.ENGINE and not run.check_only:
            self._stale_before = (run.refit_id, self.holding.stale)
            if not run.atomic:  # from now on our weights may be overwritten (atomic: only the staging)
                self.holding.stale = True
        try:
            plan = await self._plan(run)
            self._play(plan, run.rendezvous.rank)
        except Exception as e:
            await self._reply(run.refit_id, False, error=f"plan {run.plan_id}: {e}")
            return
        r = run.rendezvous
        members = tuple(r.members) or self._members.get(r.prefix, ())  # names come once per prefix
        self._members = {r.prefix: members}
        ctx = RunContext(run.plan_id, run.refit_id, run.version,
                         Rendezvous(r.host, r.port, r.prefix, r.world_size, r.rank, members), deadline,
                         phase_hook=self.phase_hook, store=self._open_store(r.prefix), atomic=run.atomic,
                         verify=run.verify, check_only=run.check_only, delta=run.delta, delta_base=run.delta_base)
        self._cancel = {run.refit_id: ctx.cancelled}
        if self._abandoned == run.refit_id:  # the coordinator gave it up before it could start
            ctx.cancelled.set()
        if self.data_plane.inline:
            await self._write(self._execute(plan, ctx))
            return
        self._running = run.refit_id
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self._execute, plan, ctx)
        self._job = asyncio.ensure_future(self._finish(fut))

    async def _finish(self, fut: asyncio.Future) -> None:
        try:
            result = await fut
        finally:
            self._running = ""  # free before the coordinator can read our answer and send more
            self._share_ended()
        try:
            await self._write(result)
            mark(f"{self.role.value}: result sent")
        except Exception as e:  # the stream is gone; the coordinator already counts us out
            log.info("%s: could not report refit %s: %s", self.worker_id, result.result.refit_id, e)

    def _open_store(self, prefix: str) -> Callable[[float], CoordinatorStore]:
        """The rendezvous store of ``prefix``: the coordinator's, reached like the coordinator."""
        return lambda timeout_s: CoordinatorStore(self.address, prefix, self.token, timeout_s)

    async def _reply(self, refit_id: str, ok: bool, error: str = "") -> None:
        """Answer a command without running it (refused, or busy): nothing of it moved."""
        await self._write(pb.WorkerMessage(result=pb.RunResult(refit_id=refit_id, ok=ok, error=error,
                                                               before_start=not ok)))

    def _on_outcome(self, out: pb.Outcome) -> None:
        mark(f"{self.role.value}: outcome received")
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] == out.refit_id and out.committed and out.refit_id == self._last_refit:
            # an atomic refit commits: the outcome is heard once the tensors switched
            self._switch_task = asyncio.ensure_future(self._switch_and_answer(*staged))  # held: the loop keeps weak refs
            self._switch_task.add_done_callback(lambda _: self._outcomes.add(out.refit_id, Outcome(True, out.error)))
            return
        self._hear(out)
        self._outcomes.add(out.refit_id, Outcome(out.committed, out.error, out.untouched))

    def _hear(self, out: pb.Outcome) -> None:
        if out.refit_id != self._last_refit:  # about a refit we no longer run: not about our weights
            log.info("%s: ignoring the outcome of refit %s (last ran %s)", self.worker_id, out.refit_id,
                     self._last_refit or "none")
            return
        if not out.committed:
            self._abandoned = out.refit_id
            ev = self._cancel.get(out.refit_id)
            if ev is not None:
                ev.set()
        if self.role is not Side.ENGINE:
            return
        h = self.holding
        if out.committed:
            h.version, h.stale = out.version, False
        elif not out.untouched:
            h.stale = True
        elif self._stale_before[0] == out.refit_id:  # moved nothing: we hold what we held before it
            h.stale = self._stale_before[1]
        h.stale = h.stale or h.pinned
        log.info("%s: refit %s %s, holding version %d%s", self.worker_id, out.refit_id,
                 "committed" if out.committed else "failed", h.version, " (stale)" if h.stale else "")


class TrainerAgent(Agent):
    """A trainer rank: the source of its boxes in every refit of plans it belongs to."""

    role = Side.TRAINER


class EngineAgent(Agent):
    """An engine rank: receives into its (vLLM-layout) tensors and reports the version it holds."""

    role = Side.ENGINE
