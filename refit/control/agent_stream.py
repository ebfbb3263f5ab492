"""An agent's stream to the coordinator: register, read its commands, stay registered.

`AgentStream` is the connection half of `refit.control.agent.Agent`, kept apart from what the agent
does with the commands it reads (runs its share of a refit, hears how a refit ended), which the
agent supplies through `_info`, `_on_run`, `_on_outcome` and `_stream_ended`.

Agents stay connected by themselves: keepalive pings (accepted by the coordinator on idle streams)
keep an idle stream open for as long as the RL loop takes between refits, and when the stream
drops (the coordinator restarted, the network broke) the agent connects and registers again,
with backoff, reporting the version it holds.  It gives up only when refused for good (bad
registration, wrong token, or replaced by another agent of its own process registering its slot)
or stopped; an agent replaced otherwise tries to come back (its slot is refused to it while the
other registration's stream lives).  Every Connect carries the process's key
(`refit.control.common.process_key`): a live worker's slot is taken over only by its own process.
The streams of all agents of a process live on one background thread and asyncio loop
(`refit.control.common.agent_loop`), so the host process is never blocked by the control plane.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
import weakref
from typing import Any, TypeVar

import grpc

from refit.control.common import (PROCESS_KEY_HEADER, agent_loop, auth_metadata, channel_options, on_agent_loop,
                                  process_key)
from refit.control.v1 import refit_pb2 as pb
from refit.control.v1 import refit_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# Refusals that another try would only repeat: the agent stops and reports them.
PERMANENT = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
             grpc.StatusCode.UNIMPLEMENTED}

# The agent of this process that registered each (coordinator, worker id) last: an agent whose
# stream ends ABORTED (replaced) stops for good only when another agent of its process took over.
_HOLDERS: "weakref.WeakValueDictionary[tuple[str, str], AgentStream]" = weakref.WeakValueDictionary()

S = TypeVar("S", bound="AgentStream")


class AgentStream:
    """Registers a worker with the coordinator at ``address`` and serves its stream until stopped."""

    def __init__(self, address: str, token: str | None, *, reconnect: bool, backoff: tuple[float, float],
                 keepalive_ms: int, keepalive_timeout_ms: int) -> None:
        self.address, self.token = address, token
        self.reconnect, self.backoff = reconnect, backoff
        self._options = channel_options(keepalive_ms, keepalive_timeout_ms)
        self._live = False  # registered on the current stream
        self.registrations = 0  # successful registrations (1 + reconnects)
        self.session = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main_future: concurrent.futures.Future | None = None
        self._call: Any = None
        self._registered = threading.Event()
        self._closed = threading.Event()
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ what the agent supplies
    @property
    def worker_id(self) -> str:
        """"group/rank", for logs and errors."""
        raise NotImplementedError

    def _info(self) -> pb.WorkerInfo:
        """This worker's registration (sent again at every reconnect: the version it holds now)."""
        raise NotImplementedError

    async def _on_run(self, run: pb.RunRefit) -> None:
        raise NotImplementedError

    def _on_outcome(self, out: pb.Outcome) -> None:
        raise NotImplementedError

    def _stream_ended(self) -> None:
        self._live = False

    def _stopped(self) -> None:
        """After `stop` ended the stream (on the agents' loop: told it to end)."""

    # ------------------------------------------------------------------ public
    @property
    def connected(self) -> bool:
        """Registered on a live stream now (False while reconnecting)."""
        return self._live and not self._closed.is_set()

    def start(self: S, timeout: float = 30.0) -> S:
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
        """Leave: end the stream (the coordinator sees a disconnect), waiting for it to end unless
        called on the agents' loop; then let go of what the agent holds (`_stopped`)."""
        if self._loop is None or self._main_future is None:
            return
        self._main_future.cancel()  # thread-safe: cancels the task, which ends the stream
        if not on_agent_loop():
            self._closed.wait(10)
        self._stopped()

    def wait_closed(self, timeout: float | None = None) -> bool:
        return self._closed.wait(timeout)

    def __enter__(self: S) -> S:
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

    async def _session(self) -> bool:
        """One stream: register, then run what the coordinator sends.  True: stop for good."""
        md = auth_metadata(self.token) + ((PROCESS_KEY_HEADER, process_key()),)
        async with grpc.aio.insecure_channel(self.address, options=self._options) as channel:
            self._stub = pb_grpc.CoordinatorStub(channel)
            self._md = md
            call = self._call = self._stub.Connect(metadata=md)
            self._wlock = asyncio.Lock()
            try:
                info = self._info()
                _HOLDERS[(self.address, self.worker_id)] = self  # before the coordinator can replace the last
                await call.write(pb.WorkerMessage(register=pb.Register(info=info)))
                msg = await call.read()
                if msg is grpc.aio.EOF or msg.WhichOneof("kind") != "registered":
                    raise ConnectionError(f"coordinator answered {msg!r} to register")
                self.session = msg.registered.session
                self._live = True
                self.registrations += 1
                self._registered.set()
                log.info("%s registered with %s (session %s, version %d)", self.worker_id, self.address,
                         self.session, info.version)
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
                if code == grpc.StatusCode.ABORTED:  # replaced: for good only by an agent of this process
                    holder = _HOLDERS.get((self.address, self.worker_id))
                    return holder is not None and holder is not self
                return code in PERMANENT
            except ConnectionError as e:
                self.error = e
                return False
            finally:
                self._stream_ended()

    async def _write(self, msg: pb.WorkerMessage) -> None:
        async with self._wlock:
            await self._call.write(msg)
