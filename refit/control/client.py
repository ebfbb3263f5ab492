"""`Client`: the RL loop's handle on the coordinator (synchronous gRPC).

    client = Client("127.0.0.1:50051")
    plan = client.create_plan("trainer", "engine")          # once
    for step in range(1, steps + 1):
        train_step()
        client.refit(plan["plan_id"], version=step)          # raises RefitFailed on failure

Plain data out: summaries and worker rows are dicts (the proto's field names), a refit is a
`RefitResult`.  A refused or failed call raises `ControlError` (a `grpc.RpcError` too, with
``code()`` and ``details()``), one subclass per status: `InvalidRequest`, `PlanNotFound`,
`VersionRefused` (FAILED_PRECONDITION), `Unauthenticated`, `Unavailable` (no coordinator there),
`DeadlineExceeded`; a refit that ran and failed raises `RefitFailed`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import grpc
from google.protobuf.descriptor import FieldDescriptor

from refit.control.common import (CHANNEL_OPTIONS, PLACEMENTS, auth_metadata, coordinator_address, coordinator_token,
                                  role_of, side_of_role)
from refit.control.v1 import refit_pb2 as pb
from refit.control.v1 import refit_pb2_grpc as pb_grpc
from refit import errors
from refit.plan import Plan
from refit.sides import Side


class ControlError(grpc.RpcError):
    """A call the coordinator refused, or that did not reach it: ``code()`` is the gRPC status."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method}: {code.name}: {details}")
        self.method, self._code, self._details = method, code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class InvalidRequest(ControlError):
    """INVALID_ARGUMENT: the request is wrong (the message says how)."""


class PlanNotFound(ControlError):
    """NOT_FOUND: no such plan on this coordinator (it may have restarted: create the plan again)."""


class VersionRefused(ControlError):
    """FAILED_PRECONDITION: a version that does not increase, or a plan its workers no longer fit."""


class Unauthenticated(ControlError):
    """UNAUTHENTICATED: missing or wrong token."""


class Unavailable(ControlError):
    """UNAVAILABLE: no coordinator reachable at the address (yet)."""


class DeadlineExceeded(ControlError):
    """DEADLINE_EXCEEDED: no answer within the call's timeout."""


_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest, grpc.StatusCode.NOT_FOUND: PlanNotFound,
           grpc.StatusCode.FAILED_PRECONDITION: VersionRefused, grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
           grpc.StatusCode.UNAVAILABLE: Unavailable, grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded}


def _call(method: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with gRPC's exceptions turned into refit's."""
    try:
        return fn(*args, **kwargs)
    except grpc.RpcError as e:
        if isinstance(e, ControlError):
            raise
        code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
        details = e.details() if callable(getattr(e, "details", None)) else str(e)
        raise _ERRORS.get(code, ControlError)(method, code, details or "") from None


def _repeated(f: FieldDescriptor) -> bool:
    # protobuf >= 6 has is_repeated (and deprecates label); 5.x has only label
    flag = getattr(f, "is_repeated", None)
    return bool(flag) if flag is not None else f.label == FieldDescriptor.LABEL_REPEATED


def to_dict(msg: Any) -> dict[str, Any]:
    """A message as plain Python: every field present, ints as ints (protobuf's JSON mapping would
    make uint64 strings), enums by name, nested messages as dicts."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        conv: Callable[[Any], Any] = lambda v: v  # noqa: E731
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            conv = to_dict
        elif f.type == FieldDescriptor.TYPE_ENUM:
            names = {n: v.name for n, v in f.enum_type.values_by_number.items()}
            conv = lambda v, names=names: names.get(v, v)  # noqa: E731
        out[f.name] = [conv(v) for v in value] if _repeated(f) else conv(value)
    return out


@dataclass(frozen=True)
class WorkerResult:
    worker_id: str
    role: str
    outcome: str  # ok, error, disconnected, timed_out, not_connected, busy, unspecified
    bytes: int
    seconds: float
    error: str


@dataclass(frozen=True)
class RefitResult:
    refit_id: str
    plan_id: str
    version: int
    ok: bool
    error: str
    seconds: float
    total_bytes: int
    workers: dict[str, WorkerResult] = field(repr=False)
    atomic: bool = False  # all or none across the engines, as asked
    verified_transfers: int = 0  # transfers whose two ends' checksums matched (verify=True)
    # delta=True: what the trainers sent over wires (changed_fraction, wire_bytes, full_bytes,
    # delta_buckets, buckets) and, when it went in full, why (`delta_fallback`); None otherwise
    delta: dict[str, Any] | None = None
    delta_fallback: str = ""

    @classmethod
    def from_pb(cls, r: pb.RefitResponse) -> "RefitResult":
        workers = {w.worker_id: WorkerResult(
            w.worker_id, side_of_role(w.role).value,
            pb.WorkerOutcome.Name(w.outcome).removeprefix("WORKER_OUTCOME_").lower(), w.bytes, w.seconds, w.error)
            for w in r.workers}
        d = r.delta if r.HasField("delta") else None
        delta = {"changed_fraction": d.changed / d.words if d.words else 0.0, "wire_bytes": d.wire_bytes,
                 "full_bytes": d.full_bytes, "delta_buckets": d.delta_buckets, "buckets": d.buckets} if d else None
        return cls(r.refit_id, r.plan_id, r.version, r.status == pb.REFIT_STATUS_OK, r.error, r.seconds,
                   r.total_bytes, workers, r.atomic, r.verified_transfers, delta, r.delta_fallback)


class RefitFailed(errors.RefitFailed):
    """A refit ran and failed (`refit.RefitFailed`); ``result`` says which workers and why."""

    def __init__(self, result: RefitResult) -> None:
        super().__init__(result.error)
        self.result = result


class Client:
    def __init__(self, address: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        """``address``: the coordinator (default ``$REFIT_ADDRESS``, else 127.0.0.1:50051);
        ``token``: default ``$REFIT_TOKEN``; ``timeout``: seconds for calls other than `refit`
        (which has its own)."""
        self.address, self.timeout = coordinator_address(address), timeout
        self._md = auth_metadata(coordinator_token(token))
        self._channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.CoordinatorStub(self._channel)

    def create_plan(self, src_group: str, dst_group: str, *, placement: str = "colocated", planner: str = "p2p",
                    bucket_bytes: int = 0) -> dict[str, Any]:
        """Plan (or find the cached plan) from a trainer group to an engine group; its summary
        (``plan_id``: the id `refit` takes).  Raises `InvalidRequest` (groups incomplete or of
        different models, naming the fields), or another `ControlError` for the call itself."""
        opts = pb.PlanOptions(placement=PLACEMENTS.get(placement, -1) if placement else 0, planner=planner,
                              bucket_bytes=bucket_bytes)
        resp = _call("CreatePlan", self._stub.CreatePlan,
                     pb.CreatePlanRequest(src_group=src_group, dst_group=dst_group, options=opts),
                     metadata=self._md, timeout=self.timeout)
        return dict(to_dict(resp.summary), cached=resp.cached)

    def get_plan(self, plan_id: str, include_plan: bool = False) -> dict[str, Any]:
        """A plan's summary; with ``include_plan`` also the `refit.plan.Plan` under "plan"."""
        resp = _call("GetPlan", self._stub.GetPlan, pb.GetPlanRequest(plan_id=plan_id, include_plan=include_plan),
                     metadata=self._md, timeout=self.timeout)
        out = to_dict(resp.summary)
        if include_plan:
            out["plan"] = Plan.from_dict(json.loads(resp.plan_json))
        return out

    def list_workers(self, group: str = "", role: str | None = None) -> list[dict[str, Any]]:
        """Every registered worker (of ``group`` / ``role`` when given), as a dict of
        ``WorkerStatus``.  Two versions, not to be confused: ``version`` and ``stale`` are what
        the worker holds *now* (an engine's weights, kept up to date by each refit; read these),
        while ``info["version"]`` (and ``info["stale"]``) is what it reported when it registered,
        never updated afterwards.  Rows of workers that left stay, with ``connected`` False."""
        req = pb.ListWorkersRequest(group=group, role=role_of(Side.named(role)) if role else pb.ROLE_UNSPECIFIED)
        resp = _call("ListWorkers", self._stub.ListWorkers, req, metadata=self._md, timeout=self.timeout)
        return [to_dict(w) for w in resp.workers]

    def refit(self, plan_id: str, version: int, timeout: float = 60.0, check: bool = True, *, atomic: bool = False,
              verify: bool = False, delta: bool = False) -> RefitResult:
        """Run the plan for ``version``; returns within ``timeout`` seconds (0: the coordinator's
        default, ``refit serve --timeout``).  ``check``: raise `RefitFailed` when it failed (the
        default: an RL loop should not go on silently).  Idempotent: asking again for the version
        of a refit under way joins it, and for the version last committed (still held by the
        engines) returns its result again.  Raises `RefitFailed` (a `refit.RefitFailed`: the refit
        started and failed; call `refit` again with a higher version once the named worker is
        back), `PlanNotFound`, `VersionRefused` (a version that does not increase) or another
        `ControlError`.

        ``atomic``: all or none across the plan's engines — each stages the version, and they
        switch together once every member succeeded; after a failure before that, every engine
        serves its previous version, whole and not stale (every engine must stage: an
        `EngineAgent` does, a vLLM engine with ``staging`` "atomic"; else `InvalidRequest`).
        ``verify``: both ends checksum every transfer, and a mismatch fails the refit naming the
        tensor, the box and both ranks (``verified_transfers`` counts the matches).
        ``delta``: the trainers send each bucket that crosses a wire as only the words changed since
        what they last sent (`refit.executor.delta`; same-GPU copies stay full); the engines end
        with the bytes a full refit gives.  In full, and ``delta_fallback`` says why, whenever an
        engine may not hold exactly what was last sent (the first delta refit, a failed or
        non-delta refit since, a worker registered again, a replica catching up, an engine that
        re-processes what it receives).  ``delta`` in the result: words changed, bytes sent."""
        req = pb.RefitRequest(plan_id=plan_id, version=version, timeout_seconds=timeout, atomic=atomic, verify=verify,
                              delta=delta)
        resp = _call("Refit", self._stub.Refit, req,
                     metadata=self._md, timeout=timeout + 10.0 if timeout else None)  # the server answers in time
        result = RefitResult.from_pb(resp)
        if check and not result.ok:
            raise RefitFailed(result)
        return result

    def check(self, plan_id: str, timeout: float = 60.0, check: bool = True) -> RefitResult:
        """Compare what the plan's engines hold now with the trainers' weights, moving nothing:
        both ends checksum every transfer of the plan (``verified_transfers`` counts the matches).
        ``check``: raise `RefitFailed` naming each differing tensor, box and both ranks (else
        return the result).  Runs after a refit of the plan under way; changes no version."""
        resp = _call("Check", self._stub.Check, pb.CheckRequest(plan_id=plan_id, timeout_seconds=timeout),
                     metadata=self._md, timeout=timeout + 10.0 if timeout else None)
        result = RefitResult.from_pb(resp)
        if check and not result.ok:
            raise RefitFailed(result)
        return result

    def watch(self, plan_id: str = "") -> Iterator[dict[str, Any]]:
        """Refit events as they happen (of ``plan_id``'s refits, or all), and workers joining and
        leaving (``kind`` KIND_WORKER_JOINED / KIND_WORKER_LEFT, ``member`` as `list_workers`
        shows it), whatever plan is watched (blocks; close the iterator, or the client, to stop)."""
        call = self._stub.WatchRefits(pb.WatchRefitsRequest(plan_id=plan_id), metadata=self._md)
        try:
            while True:
                event = _call("WatchRefits", next, call, None)
                if event is None:
                    return
                yield to_dict(event)
        finally:
            call.cancel()

    def health(self, service: str = "") -> str:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        resp = _call("Check", health_pb2_grpc.HealthStub(self._channel).Check,
                     health_pb2.HealthCheckRequest(service=service), metadata=self._md, timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
