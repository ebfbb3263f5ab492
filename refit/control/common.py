"""What the coordinator, the agents and the client share: names, errors, channel settings, and
how a model travels in a registration (its `ModelConfig` as JSON, so the coordinator can plan
without the checkpoint)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import threading
from typing import Any

from refit import settings
from refit.control.v1 import refit_pb2 as pb
from refit.errors import InvalidInput, RefitFailed
from refit.sides import Side  # re-exported: integrations import it from here
from refit.spec import ModelConfig, ModelSpec, build_spec

DEFAULT_PORT = 50051
SERVICE_NAME = "refit.v1.Coordinator"


def role_of(side: Side) -> pb.Role:
    """The proto's ``Role`` of a side (kept here: the ground-floor `refit.sides` knows no proto)."""
    return pb.ROLE_TRAINER if side is Side.TRAINER else pb.ROLE_ENGINE


def side_of_role(role: int) -> Side:
    """The side of a proto ``Role``; InvalidInput for ``ROLE_UNSPECIFIED`` or an unknown one."""
    if role == pb.ROLE_TRAINER:
        return Side.TRAINER
    if role == pb.ROLE_ENGINE:
        return Side.ENGINE
    raise InvalidInput(f"role must be ROLE_TRAINER or ROLE_ENGINE, not {role}")


# Placement names as refit's planners spell them, and their proto enum (the one map of both).
PLACEMENTS = {"colocated": pb.PLACEMENT_COLOCATED, "disaggregated": pb.PLACEMENT_DISAGGREGATED}
PLACEMENT_NAMES = {pb.PLACEMENT_UNSPECIFIED: "colocated", **{v: k for k, v in PLACEMENTS.items()}}

# Keepalive: pings every KEEPALIVE_MS notice a peer whose host vanished (its socket lingers) instead
# of waiting on TCP timeouts.  The server must accept pings that often, even on an idle stream, or
# it answers GOAWAY "too_many_pings" and drops idle agents (RL steps are often minutes apart).
KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS = 10_000, 5_000
# Workers and clients send small messages (a registration is a few KiB); a server reading at most
# this much per message cannot be made to buffer hundreds of MiB by an unauthenticated caller.
# Plans of large models run to megabytes of JSON, and travel the other way.
MAX_REQUEST_BYTES = 4 * 2**20
MAX_PLAN_BYTES = 512 * 2**20


def channel_options(keepalive_ms: int = KEEPALIVE_MS, keepalive_timeout_ms: int = KEEPALIVE_TIMEOUT_MS
                    ) -> list[tuple[str, int]]:
    """Options of agents' and clients' channels (real grpc core channel-arg names)."""
    return [("grpc.max_send_message_length", MAX_REQUEST_BYTES),
            ("grpc.max_receive_message_length", MAX_PLAN_BYTES),
            ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_timeout_ms", keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]  # 0: no limit on pings of an idle stream


def server_options(keepalive_ms: int = KEEPALIVE_MS, keepalive_timeout_ms: int = KEEPALIVE_TIMEOUT_MS
                   ) -> list[tuple[str, int]]:
    """Options of the coordinator's server.  ``grpc.so_reuseport`` 0: a second coordinator on a
    taken port fails to start instead of sharing it (and splitting the registrations)."""
    return [("grpc.max_send_message_length", MAX_PLAN_BYTES),
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_timeout_ms", keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            # accept client pings down to half their interval, on idle streams too
            ("grpc.http2.min_ping_interval_without_data_ms", max(1, keepalive_ms // 2)),
            ("grpc.http2.max_ping_strikes", 0),  # 0: never GOAWAY a pinging client
            ("grpc.so_reuseport", 0)]


CHANNEL_OPTIONS = channel_options()
SERVER_OPTIONS = server_options()


class NotFound(InvalidInput):
    """An unknown plan (NOT_FOUND)."""


class Exhausted(InvalidInput):
    """A limit of the coordinator is reached (too many workers or plans: RESOURCE_EXHAUSTED)."""


class Conflict(InvalidInput):
    """A registration for a slot a live worker holds (ALREADY_EXISTS)."""


class Aborted(RefitFailed):
    """A call under a rendezvous the coordinator abandoned (ABORTED): its refit failed."""


class Precondition(InvalidInput):
    """A well-formed request the current state refuses, e.g. a version that does not increase
    (FAILED_PRECONDITION)."""


_AGENT_LOOP: asyncio.AbstractEventLoop | None = None
_AGENT_THREAD: threading.Thread | None = None
_AGENT_LOCK = threading.Lock()


def agent_loop() -> asyncio.AbstractEventLoop:
    """The one event loop (on a daemon thread) that every agent of this process runs on: grpc.aio
    wants one loop per process, and one thread for all streams keeps the host process quiet."""
    global _AGENT_LOOP, _AGENT_THREAD
    with _AGENT_LOCK:
        if _AGENT_LOOP is None:
            _AGENT_LOOP = new_event_loop()
            _AGENT_THREAD = threading.Thread(target=_AGENT_LOOP.run_forever, name="refit-agents", daemon=True)
            _AGENT_THREAD.start()
        return _AGENT_LOOP


def on_agent_loop() -> bool:
    """Whether the calling thread is the agents' event loop thread (which must never wait on itself)."""
    return threading.current_thread() is _AGENT_THREAD


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (about a fifth less CPU per message here), else asyncio's own loop;
    REFIT_UVLOOP=0 forces asyncio's."""
    if settings.current().uvloop:
        try:
            import uvloop

            return uvloop.new_event_loop()
        except ImportError:
            pass
    return asyncio.new_event_loop()


def worker_id(group: str, rank: int) -> str:
    return f"{group}/{rank}"


def coordinator_address(address: str | None) -> str:
    """The coordinator to reach: ``address``, else ``REFIT_ADDRESS``, else the loopback default."""
    return address or settings.current().address or f"127.0.0.1:{DEFAULT_PORT}"


def coordinator_token(token: str | None) -> str | None:
    """The bearer token to send: ``token``, else ``REFIT_TOKEN``, else none."""
    return token or settings.current().token or None


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


# Proof that a registration comes from the process holding a slot: a random key of each process,
# sent on its agents' Connect calls and never shown by the coordinator (ListWorkers shows host and
# pid, which anyone can claim).  A live worker's slot is taken over only by its own process.
PROCESS_KEY_HEADER = "refit-process-key"
_process_key: tuple[int, str] = (0, "")


def process_key() -> str:
    """This process's key (made anew in a forked child, which is another process)."""
    global _process_key
    if _process_key[0] != os.getpid():
        _process_key = (os.getpid(), secrets.token_hex(16))
    return _process_key[1]


def short(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: error messages never echo huge inputs."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def config_json(config: ModelConfig) -> str:
    """A registration's model config (``ModelConfig.from_fields`` of it read back is ``config``)."""
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def spec_from_registration(name: str, config: str, digest: str) -> ModelSpec:
    """Rebuild a worker's model spec from its registration; refuse one whose digest disagrees."""
    try:
        fields: dict[str, Any] = json.loads(config)
        if not isinstance(fields, dict):
            raise TypeError("not a JSON object")
        spec = build_spec(name, ModelConfig.from_fields(fields))
    except (ValueError, TypeError) as e:
        raise InvalidInput(f"model_config_json is not a refit ModelConfig: {short(str(e))}") from None
    if spec.digest() != digest:
        raise InvalidInput(f"model {short(name)}: model_config_json gives digest {spec.digest()}, "
                         f"the worker reported {short(digest or '(none)')}")
    return spec
