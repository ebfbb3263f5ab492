"""Worker agents: the control-plane end inside a trainer rank or an engine rank.

An agent registers its rank with the coordinator over one long-lived stream, then runs its share
of every refit it is told to run, through a pluggable data plane (`refit.control.dataplane`):

    agent = TrainerAgent("127.0.0.1:50051", group="trainer", rank=r, spec=spec,
                         layout="megatron:tp4ep8", tensors=lambda: local_tensors(model)).start()

``tensors``: the rank's local tensors, or a callable read at every refit that follows the model
(`refit.control.dataplane.TensorSource`).  The streams of all agents of a process live on one
background thread and asyncio loop, so the host process (a training loop, a vLLM worker) is never
blocked by the control plane; each agent's data plane runs on a thread of its own (one refit at a
time: a command while one still runs is answered "busy": a stale share never overwrites a newer one).  An `EngineAgent` knows the version
of the weights it holds: stale from the moment a refit starts writing until the coordinator says
it was committed.

Agents stay connected by themselves: keepalive pings (accepted by the coordinator on idle streams)
keep an idle stream open for as long as the RL loop takes between refits, and when the stream
drops (the coordinator restarted, the network broke) the agent connects and registers again,
with backoff, reporting the version it holds.  It gives up only when refused for good (bad
registration, wrong token, or replaced by a newer registration of its slot) or stopped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import random
import threading
import time
from typing import Any, Callable, ClassVar

import grpc

from refit.control.common import (KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS, ROLES, agent_loop, auth_metadata, channel_options,
                                  config_json, on_agent_loop, worker_id)
from refit.control.dataplane import (DataPlane, PhaseHook, Rendezvous, RunContext, Tensors, TensorSource,
                                     check_tensors)
from refit.control.store_client import CoordinatorStore
from refit.control.v1 import refit_pb2 as pb
from refit.control.v1 import refit_pb2_grpc as pb_grpc
from refit.errors import InvalidInput
from refit.layouts import Layout, resolve_layout
from refit.plan import Plan
from refit.spec import ModelSpec

log = logging.getLogger(__name__)

# Refusals that another try would only repeat: the agent stops and reports them.
PERMANENT = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
             grpc.StatusCode.ABORTED, grpc.StatusCode.UNIMPLEMENTED}


class Agent:
    role: ClassVar[str]

    def __init__(self, address: str, *, group: str, rank: int, spec: ModelSpec, layout: str | Layout,
                 tensors: TensorSource | None = None, data_plane: DataPlane | None = None,
                 host: str = "127.0.0.1", gpu: int = -1, token: str | None = None, version: int = 0,
                 reconnect: bool = True, backoff: tuple[float, float] = (0.1, 5.0),
                 keepalive_ms: int = KEEPALIVE_MS, keepalive_timeout_ms: int = KEEPALIVE_TIMEOUT_MS,
                 phase_layers: int = 0, phase_hook: PhaseHook | None = None) -> None:
        """``tensors``: this rank's local tensors by local name, or a callable returning them at
        every refit (`TensorSource`); ``None``: none, for data planes that need none (tests,
        benches).  ``data_plane`` defaults to `refit.executor` (gloo on CPU, CUDA IPC / NCCL on GPUs).
        ``reconnect``: register again by itself when the stream drops, waiting between tries from
        ``backoff[0]`` doubling up to ``backoff[1]`` seconds.  ``keepalive_ms``: ping interval
        (the coordinator's own must not be above it; tests shorten both).  ``phase_layers`` (engines):
        plans into this group are cut into phases of that many layers (`refit.phases`; 0: not
        phased); ``phase_hook`` checks each plan before it runs and hears each phase land."""
        self.address, self.group, self.rank, self.spec = address, group, rank, spec
        self.layout = resolve_layout(layout, spec, "src" if self.role == "trainer" else "dst") \
            if isinstance(layout, str) else layout.resolve(spec)
        if not 0 <= rank < self.layout.world_size:
            raise InvalidInput(f"rank {rank} is outside {self.layout.describe()} (world size {self.layout.world_size})")
        self._source: TensorSource = tensors if tensors is not None else {}
        if tensors is not None:
            self._read_tensors()  # a wrong tensor is refused before registering
        if data_plane is None:
            from refit.control.dataplane_executor import ExecutorDataPlane

            data_plane = ExecutorDataPlane()
        self.data_plane = data_plane
        self.host, self.gpu, self.token = host, gpu, token
        if phase_layers < 0:
            raise InvalidInput(f"phase_layers must be >= 0, got {phase_layers}")
        self.phase_layers, self.phase_hook = phase_layers, phase_hook
        self.reconnect, self.backoff = reconnect, backoff
        self._options = channel_options(keepalive_ms, keepalive_timeout_ms)
        self._version, self._stale = version, False
        self._stale_before: tuple[str, bool] = ("", False)  # (refit id, staleness before it started here)
        self._live = False  # registered on the current stream
        self._running = ""  # refit id whose share runs on our thread
        self._last_refit = ""  # the refit we were last told to run: outcomes of others are ignored
        self._abandoned = ""  # the last refit the coordinator told us to abandon
        self._waiting: asyncio.Future | None = None  # a run queued behind an abandoned share
        self.registrations = 0  # successful registrations (1 + reconnects)
        self.session = ""
        self._plans: dict[str, Plan] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"refit-{self.worker_id}")
        self._job: asyncio.Future | None = None
        self._cancel: dict[str, threading.Event] = {}
        self._members: dict[str, tuple[str, ...]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main_future: concurrent.futures.Future | None = None
        self._call: Any = None
        self._registered = threading.Event()
        self._closed = threading.Event()
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ public
    @property
    def worker_id(self) -> str:
        return worker_id(self.group, self.rank)

    @property
    def tensors(self) -> Tensors:
        """This rank's local tensors now (a callable source read, and checked against the layout)."""
        return self._read_tensors() if callable(self._source) else self._source

    def _read_tensors(self) -> Tensors:
        tensors = self._source() if callable(self._source) else self._source
        check_tensors(self.spec, self.layout, self.rank, tensors)
        return tensors

    @property
    def version(self) -> int:
        """The version of the weights this worker holds (engines; trainers report 0)."""
        return self._version

    @property
    def stale(self) -> bool:
        return self._stale

    @property
    def connected(self) -> bool:
        """Registered on a live stream now (False while reconnecting)."""
        return self._live and not self._closed.is_set()

    def start(self, timeout: float = 30.0) -> "Agent":
        """Connect and register; returns once the coordinator accepted.  Raises `ConnectionError`
        when it refused for good (its reason: a bad registration, a wrong token, a slot a live
        worker holds), or when no registration succeeded within ``timeout``.  (Bad tensors or
        layouts were refused at construction, with `refit.InvalidInput`.)"""
        if self.connected:
            return self
        if self._main_future is None or self._main_future.done():  # else: it is reconnecting already
            self._registered.clear()
            self._closed.clear()
            self.error = None
            self._loop = agent_loop()
            self._main_future = asyncio.run_coroutine_threadsafe(self._guarded_main(), self._loop)
        end = time.monotonic() + timeout
        while not self.connected:
            if self._closed.is_set() or time.monotonic() > end:
                break
            self._registered.wait(0.01)
        if not self.connected:
            self.stop()
            raise ConnectionError(f"{self.worker_id}: registration with {self.address} failed: {self.error or 'timed out'}")
        return self

    def stop(self) -> None:
        """Leave: end the stream (the coordinator sees a disconnect); close the data plane (its communicators,
        maps of peers' memory) on the share thread, after a share still running has ended."""
        loop = self._loop
        if loop is None or self._main_future is None:
            return
        self._main_future.cancel()  # thread-safe: cancels the task, which ends the stream
        waits = not on_agent_loop()
        if waits:
            self._closed.wait(10)
        close = getattr(self.data_plane, "close", None)
        if close is not None:
            try:
                done = self._pool.submit(close)
            except RuntimeError:  # the interpreter is exiting: nothing to give back
                return
            concurrent.futures.wait((done,), timeout=10 if waits else 0)

    def wait_closed(self, timeout: float | None = None) -> bool:
        return self._closed.wait(timeout)

    def __enter__(self) -> "Agent":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ stream
    async def _guarded_main(self) -> None:
        """Connect, register, serve the stream; again after a drop (backoff) unless refused for good."""
        wait = self.backoff[0]
        try:
            while True:
                registered_before = self.registrations
                if await self._session() or not self.reconnect:
                    break
                if self.registrations > registered_before:
                    wait = self.backoff[0]  # it worked for a while: start the backoff over
                await asyncio.sleep(wait * random.uniform(0.5, 1.0))
                wait = min(2 * wait, self.backoff[1])
        except asyncio.CancelledError:
            pass
        except BaseException as e:  # a bug: reported through start() / self.error
            self.error = e
            log.exception("%s: agent loop failed", self.worker_id)
        finally:
            self._call, self._live = None, False
            self._closed.set()

    def _info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(role=ROLES[self.role], group=self.group, rank=self.rank, host=self.host, gpu=self.gpu,
                             layout=self.layout.describe(), model_name=self.spec.name, model_digest=self.spec.digest(),
                             model_config_json=config_json(self.spec.config), version=self._version,
                             stale=self._stale, pid=os.getpid(), phase_layers=self.phase_layers)

    async def _session(self) -> bool:
        """One stream: register, then run what the coordinator sends.  True: stop for good."""
        md = auth_metadata(self.token)
        async with grpc.aio.insecure_channel(self.address, options=self._options) as channel:
            self._stub = pb_grpc.CoordinatorStub(channel)
            self._md = md
            call = self._call = self._stub.Connect(metadata=md)
            self._wlock = asyncio.Lock()
            try:
                await call.write(pb.WorkerMessage(register=pb.Register(info=self._info())))
                msg = await call.read()
                if msg is grpc.aio.EOF or msg.WhichOneof("kind") != "registered":
                    raise ConnectionError(f"coordinator answered {msg!r} to register")
                self.session = msg.registered.session
                self._live = True
                self.registrations += 1
                self._registered.set()
                log.info("%s registered with %s (session %s, version %d)", self.worker_id, self.address,
                         self.session, self._version)
                while True:
                    msg = await call.read()
                    if msg is grpc.aio.EOF:
                        log.warning("%s: the coordinator ended the stream", self.worker_id)
                        return False
                    kind = msg.WhichOneof("kind")
                    if kind == "run":
                        await self._on_run(msg.run)
                    elif kind == "outcome":
                        self._on_outcome(msg.outcome)
            except grpc.aio.AioRpcError as e:
                # A write racing the server's refusal fails with a generic error: the call's own
                # status says why (UNAUTHENTICATED, INVALID_ARGUMENT...).
                try:
                    code, details = await asyncio.wait_for(call.code(), 2.0), await call.details()
                except (asyncio.TimeoutError, grpc.aio.AioRpcError):
                    code, details = e.code(), e.details()
                self.error = ConnectionError(f"{code.name}: {details}")
                log.warning("%s: stream ended: %s %s", self.worker_id, code.name, details)
                return code in PERMANENT
            except ConnectionError as e:
                self.error = e
                return False
            finally:
                self._stream_ended()

    def _stream_ended(self) -> None:
        """A share still running is abandoned (a later run waits for it to end); a run queued behind
        it came on this stream, whose coordinator counts us out already: it must not start later,
        alone, and hold our thread until its own timeout."""
        self._live = False
        for ev in self._cancel.values():
            ev.set()
        if self._waiting is not None:
            self._waiting.cancel()
            self._waiting = None

    async def _write(self, msg: pb.WorkerMessage) -> None:
        async with self._wlock:
            await self._call.write(msg)

    # ------------------------------------------------------------------ refits
    async def _on_run(self, run: pb.RunRefit) -> None:
        deadline = time.monotonic() + run.timeout_seconds
        self._last_refit = run.refit_id
        if self._running:
            # A share abandoned with our last stream (the coordinator restarted, the network broke)
            # still has to end: wait for it within this run's time, rather than answer "busy" to a
            # coordinator that cannot know about it.  Reading the stream goes on meanwhile.
            self._waiting = asyncio.ensure_future(self._after_previous(run, deadline))
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
        if self.role == "engine":
            self._stale_before = (run.refit_id, self._stale)
            self._stale = True  # from now on our weights may be overwritten
        try:
            plan = await self._plan(run)
        except Exception as e:
            await self._reply(run.refit_id, False, error=f"plan {run.plan_id}: {e}")
            return
        r = run.rendezvous
        members = tuple(r.members) or self._members.get(r.prefix, ())  # names come once per prefix
        self._members = {r.prefix: members}
        ctx = RunContext(run.plan_id, run.refit_id, self.spec, self.layout,
                         Rendezvous(r.host, r.port, r.prefix, r.world_size, r.rank, members), deadline, self.host,
                         phase_hook=self.phase_hook, store=self._open_store(r.prefix))
        self._cancel = {run.refit_id: ctx.cancelled}
        if self._abandoned == run.refit_id:  # the coordinator gave it up before it could start
            ctx.cancelled.set()
        if getattr(self.data_plane, "inline", False):
            await self._write(self._execute(plan, run.version, ctx))
            return
        self._running = run.refit_id
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self._execute, plan, run.version, ctx)
        self._job = asyncio.ensure_future(self._finish(fut))

    async def _finish(self, fut: asyncio.Future) -> None:
        try:
            result = await fut
        finally:
            self._running = ""  # free before the coordinator can read our answer and send more
        try:
            await self._write(result)
        except Exception as e:  # the stream is gone; the coordinator already counts us out
            log.info("%s: could not report refit %s: %s", self.worker_id, result.result.refit_id, e)

    def _open_store(self, prefix: str) -> Callable[[float], CoordinatorStore]:
        """The rendezvous store of ``prefix``: the coordinator's, reached like the coordinator."""
        return lambda timeout_s: CoordinatorStore(self.address, prefix, self.token, timeout_s)

    def _execute(self, plan: Plan, version: int, ctx: RunContext) -> pb.WorkerMessage:
        in_plane = False
        try:
            ctx.remaining()
            if self.phase_hook is not None:  # a refusal: nothing moves (we never reach the start barrier)
                self.phase_hook.check(plan)
            tensors = self.tensors
            in_plane = True
            nbytes, seconds = self.data_plane(plan, self.role, self.rank, tensors, version, ctx)
        except Exception as e:
            log.warning("%s: refit %s failed: %s: %s", self.worker_id, ctx.refit_id, type(e).__name__, e)
            # Only a data plane that says when it reaches the start barrier can prove it did not.
            before = not in_plane or (getattr(self.data_plane, "reports_start", False) and not ctx.reached_start.is_set())
            return pb.WorkerMessage(result=pb.RunResult(refit_id=ctx.refit_id, ok=False, error=f"{type(e).__name__}: {e}",
                                                        before_start=before))
        return pb.WorkerMessage(result=pb.RunResult(refit_id=ctx.refit_id, ok=True, bytes=nbytes, seconds=seconds))

    async def _reply(self, refit_id: str, ok: bool, error: str = "") -> None:
        """Answer a command without running it (refused, or busy): nothing of it moved."""
        await self._write(pb.WorkerMessage(result=pb.RunResult(refit_id=refit_id, ok=ok, error=error,
                                                               before_start=not ok)))

    async def _plan(self, run: pb.RunRefit) -> Plan:
        """The plan of a command: sent along the first time, cached, else fetched with GetPlan."""
        plan = self._plans.get(run.plan_id)
        if plan is not None and not run.plan_json:
            return plan
        data = run.plan_json
        if not data:
            resp = await self._stub.GetPlan(pb.GetPlanRequest(plan_id=run.plan_id, include_plan=True), metadata=self._md)
            data = resp.plan_json
        plan = Plan.from_dict(json.loads(data))
        mine = plan.src_layout if self.role == "trainer" else plan.dst_layout
        if plan.model_digest != self.spec.digest() or mine != self.layout.describe():
            raise InvalidInput(f"plan is for {plan.model_digest} {mine}, this worker holds "
                             f"{self.spec.digest()} {self.layout.describe()}")
        self._plans[run.plan_id] = plan
        return plan

    def _on_outcome(self, out: pb.Outcome) -> None:
        if out.refit_id != self._last_refit:  # about a refit we no longer run: not about our weights
            log.info("%s: ignoring the outcome of refit %s (last ran %s)", self.worker_id, out.refit_id,
                     self._last_refit or "none")
            return
        if not out.committed:
            self._abandoned = out.refit_id
            ev = self._cancel.get(out.refit_id)
            if ev is not None:
                ev.set()
        if self.role != "engine":
            return
        if out.committed:
            self._version, self._stale = out.version, False
        elif not out.untouched:
            self._stale = True
        elif self._stale_before[0] == out.refit_id:  # moved nothing: we hold what we held before it
            self._stale = self._stale_before[1]
        log.info("%s: refit %s %s, holding version %d%s", self.worker_id, out.refit_id,
                 "committed" if out.committed else "failed", self._version, " (stale)" if self._stale else "")


class TrainerAgent(Agent):
    """A trainer rank: the source of its boxes in every refit of plans it belongs to."""

    role = "trainer"


class EngineAgent(Agent):
    """An engine rank: receives into its (vLLM-layout) tensors and reports the version it holds."""

    role = "engine"
