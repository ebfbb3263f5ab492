"""The coordinator's gRPC service: one handler per call of proto/refit/v1/refit.proto, each
checking its request and handing it to the `Coordinator`.

Kept apart from `refit.control.server`, which serves it (the gRPC server, the token interceptor,
the health service, `refit serve`'s command line): here is what a call does with its request.

Malformed requests never reach a handler as an exception: requests are parsed by deserializers
that turn undecodable bytes into a marker, answered with INVALID_ARGUMENT.  `RefitError` (bad
input) maps to INVALID_ARGUMENT, `NotFound` to NOT_FOUND, `Aborted` to ABORTED, `Precondition` to
FAILED_PRECONDITION, `Conflict` to ALREADY_EXISTS, `Exhausted` to RESOURCE_EXHAUSTED; anything else
is a bug: logged with its traceback, INTERNAL to the caller.  The rendezvous store the workers'
data planes meet on is served here too (`Store*` calls, `refit.control.rendezvous`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from refit.control.common import Aborted, Conflict, Exhausted, NotFound, PROCESS_KEY_HEADER, Precondition
from refit.control.coordinator import Coordinator
from refit.control.v1 import refit_pb2 as pb
from refit.errors import InvalidInput, RefitError

log = logging.getLogger("refit.control.server")  # one logger for the server and its calls: `refit serve` logs both

MAX_TIMEOUT = 7 * 86_400.0  # seconds a refit may be given: a week


class _Malformed:
    """What a request that does not parse becomes (see `_parser`)."""


MALFORMED = _Malformed()


def _parser(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError:
            return MALFORMED
    return parse


def _rpc(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Map refit's exceptions to status codes, for unary handlers."""
    @functools.wraps(fn)
    async def wrapper(self: "Servicer", request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request is MALFORMED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{fn.__name__}: request does not parse")
        try:
            return await fn(self, request, context)
        except RefitError as e:
            await context.abort(status_code(e), str(e))
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # a bug: keep the traceback in our log, not in the caller's face
            log.exception("%s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__}: internal error ({type(e).__name__})")
    return wrapper


def status_code(e: RefitError) -> grpc.StatusCode:
    for cls, code in ((NotFound, grpc.StatusCode.NOT_FOUND), (Aborted, grpc.StatusCode.ABORTED),
                      (Precondition, grpc.StatusCode.FAILED_PRECONDITION),
                      (Conflict, grpc.StatusCode.ALREADY_EXISTS), (Exhausted, grpc.StatusCode.RESOURCE_EXHAUSTED)):
        if isinstance(e, cls):
            return code
    return grpc.StatusCode.INVALID_ARGUMENT


class Servicer:
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    async def Connect(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        if first is MALFORMED or first.WhichOneof("kind") != "register":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Connect: the first message must be `register`")
        lock = asyncio.Lock()

        async def send(msg: pb.CoordinatorMessage) -> None:
            async with lock:
                await context.write(msg)

        try:
            key = dict(context.invocation_metadata() or ()).get(PROCESS_KEY_HEADER, "")
            worker = await self.coord.register(first.register.info, send, asyncio.current_task(), key)
        except RefitError as e:
            await context.abort(status_code(e), str(e))
        why = "its stream ended"
        try:
            await send(pb.CoordinatorMessage(registered=pb.Registered(worker_id=worker.worker_id, session=worker.session)))
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    break
                kind = None if msg is MALFORMED else msg.WhichOneof("kind")
                if kind not in ("result", "switched"):
                    why = "it sent a malformed message"
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        "Connect: expected a `result` or `switched` message")
                if kind == "result":
                    self.coord.result(worker, msg.result)
                else:
                    self.coord.switched(worker, msg.switched)
        except asyncio.CancelledError:
            if not worker.replaced:  # the server is stopping
                raise
            why = "replaced by a new registration"  # end the old stream with a reason
            await context.abort(grpc.StatusCode.ABORTED, f"{worker.worker_id}: {why}")
        finally:
            self.coord.disconnected(worker, why)

    @_rpc
    async def CreatePlan(self, req: pb.CreatePlanRequest, context: Any) -> pb.CreatePlanResponse:
        entry, cached = await self.coord.create_plan(req.src_group, req.dst_group, req.options)
        return pb.CreatePlanResponse(summary=entry.to_pb(), cached=cached)

    @_rpc
    async def GetPlan(self, req: pb.GetPlanRequest, context: Any) -> pb.GetPlanResponse:
        entry = self.coord.get_plan(req.plan_id)
        return pb.GetPlanResponse(summary=entry.to_pb(), plan_json=entry.plan_json if req.include_plan else b"")

    @_rpc
    async def ListWorkers(self, req: pb.ListWorkersRequest, context: Any) -> pb.ListWorkersResponse:
        if req.role not in pb.Role.values():
            raise InvalidInput(f"unknown role {req.role}")
        return pb.ListWorkersResponse(workers=self.coord.list_workers(req.group, req.role))

    @_rpc
    async def Refit(self, req: pb.RefitRequest, context: grpc.aio.ServicerContext) -> pb.RefitResponse:
        timeout = self._run_timeout(req, context)
        return await self.coord.refit(req.plan_id, req.version, timeout, atomic=req.atomic, verify=req.verify,
                                      delta=req.delta)

    @_rpc
    async def Check(self, req: pb.CheckRequest, context: grpc.aio.ServicerContext) -> pb.RefitResponse:
        return await self.coord.check(req.plan_id, self._run_timeout(req, context))

    def _run_timeout(self, req: pb.RefitRequest | pb.CheckRequest, context: grpc.aio.ServicerContext) -> float:
        """The seconds a Refit or Check of ``req.plan_id`` may run: its own timeout (checked) or
        the coordinator's default, cut to answer FAILED before the caller's deadline cuts the call."""
        if not req.plan_id:
            raise InvalidInput("plan_id is required")
        if not 0 <= req.timeout_seconds <= MAX_TIMEOUT:  # beyond it, members' timers overflow (timedelta)
            raise InvalidInput(f"timeout_seconds must be a number in [0, {MAX_TIMEOUT:g}], got {req.timeout_seconds}")
        timeout = req.timeout_seconds or self.coord.default_timeout
        left = context.time_remaining()
        if left is not None:
            timeout = min(timeout, max(0.01, left - 0.05))
        return timeout

    @_rpc
    async def StoreSet(self, req: pb.StoreSetRequest, context: Any) -> pb.StoreSetResponse:
        self.coord.store.set(req.prefix, list(req.keys), list(req.values))
        return pb.StoreSetResponse()

    @_rpc
    async def StoreGet(self, req: pb.StoreGetRequest, context: grpc.aio.ServicerContext) -> pb.StoreGetResponse:
        wait = req.wait_seconds
        if not 0 <= wait <= MAX_TIMEOUT:
            raise InvalidInput(f"wait_seconds must be a number in [0, {MAX_TIMEOUT:g}], got {wait}")
        left = context.time_remaining()
        if left is not None:  # answer "not found" before the caller's own deadline cuts the call
            wait = min(wait, max(0.0, left - 0.05))
        values = await self.coord.store.get(req.prefix, list(req.keys), wait)
        return pb.StoreGetResponse(found=values is not None, values=values or ())

    @_rpc
    async def StoreAdd(self, req: pb.StoreAddRequest, context: Any) -> pb.StoreAddResponse:
        return pb.StoreAddResponse(value=self.coord.store.add(req.prefix, req.key, req.amount))

    async def WatchRefits(self, req: Any, context: grpc.aio.ServicerContext) -> None:
        if req is MALFORMED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "WatchRefits: request does not parse")
        try:
            q = self.coord.watch(req.plan_id)
        except NotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        try:
            while True:
                event = await q.get()
                if event is None:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "WatchRefits: fell too far behind")
                await context.write(event)
        finally:
            self.coord.unwatch(q)


def method_handlers(s: Servicer) -> dict[str, grpc.RpcMethodHandler]:
    """The service's calls by name, each with its request parser and response serializer (what
    `refit.control.server.CoordinatorServer` serves under `SERVICE_NAME`)."""
    ser = lambda m: m.SerializeToString  # noqa: E731
    return {
        "Connect": grpc.stream_stream_rpc_method_handler(s.Connect, _parser(pb.WorkerMessage), ser(pb.CoordinatorMessage)),
        "CreatePlan": grpc.unary_unary_rpc_method_handler(s.CreatePlan, _parser(pb.CreatePlanRequest), ser(pb.CreatePlanResponse)),
        "GetPlan": grpc.unary_unary_rpc_method_handler(s.GetPlan, _parser(pb.GetPlanRequest), ser(pb.GetPlanResponse)),
        "ListWorkers": grpc.unary_unary_rpc_method_handler(s.ListWorkers, _parser(pb.ListWorkersRequest), ser(pb.ListWorkersResponse)),
        "Refit": grpc.unary_unary_rpc_method_handler(s.Refit, _parser(pb.RefitRequest), ser(pb.RefitResponse)),
        "Check": grpc.unary_unary_rpc_method_handler(s.Check, _parser(pb.CheckRequest), ser(pb.RefitResponse)),
        "WatchRefits": grpc.unary_stream_rpc_method_handler(s.WatchRefits, _parser(pb.WatchRefitsRequest), ser(pb.RefitEvent)),
        "StoreSet": grpc.unary_unary_rpc_method_handler(s.StoreSet, _parser(pb.StoreSetRequest), ser(pb.StoreSetResponse)),
        "StoreGet": grpc.unary_unary_rpc_method_handler(s.StoreGet, _parser(pb.StoreGetRequest), ser(pb.StoreGetResponse)),
        "StoreAdd": grpc.unary_unary_rpc_method_handler(s.StoreAdd, _parser(pb.StoreAddRequest), ser(pb.StoreAddResponse)),
    }
