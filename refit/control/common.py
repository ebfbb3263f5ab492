"""What the coordinator, the agents and the client share: names, errors, channel settings, and
how a model travels in a registration (its `ModelConfig` as JSON, so the coordinator can plan
without the checkpoint)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from typing import Any

from refit.control.v1 import refit_pb2 as pb
from refit.errors import RefitError
from refit.spec import ModelConfig, ModelSpec, build_spec

DEFAULT_PORT = 50051
SERVICE_NAME = "refit.v1.Coordinator"
ROLES = {"trainer": pb.ROLE_TRAINER, "engine": pb.ROLE_ENGINE}
ROLE_NAMES = {v: k for k, v in ROLES.items()}

# Plans of large models run to megabytes of JSON; keepalive notices dead peers whose sockets
# linger (a host that vanished) instead of waiting on TCP timeouts.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 512 * 2**20),
    ("grpc.max_receive_message_length", 512 * 2**20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", 512 * 2**20),
    ("grpc.max_receive_message_length", 512 * 2**20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Never answer early pings with GOAWAY "too_many_pings": on a loaded host (a vLLM engine
    # starting next to idle trainer agents) the server's loop runs late, two 10 s pings look
    # closer than 5 s, and after two such strikes idle agents were cut off.
    ("grpc.http2.max_ping_strikes", 0),
]


class NotFound(RefitError):
    """An unknown plan (NOT_FOUND)."""


class Precondition(RefitError):
    """A well-formed request the current state refuses, e.g. a version that does not increase
    (FAILED_PRECONDITION)."""


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (about a fifth less CPU per message here), else asyncio's own loop;
    REFIT_UVLOOP=0 forces asyncio's."""
    if os.environ.get("REFIT_UVLOOP", "1") != "0":
        try:
            import uvloop

            return uvloop.new_event_loop()
        except ImportError:
            pass
    return asyncio.new_event_loop()


def worker_id(group: str, rank: int) -> str:
    return f"{group}/{rank}"


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def config_json(config: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def spec_from_registration(name: str, config: str, digest: str) -> ModelSpec:
    """Rebuild a worker's model spec from its registration; refuse one whose digest disagrees."""
    try:
        fields: dict[str, Any] = json.loads(config)
        if not isinstance(fields, dict):
            raise TypeError("not a JSON object")
        fields["moe_layers"] = tuple(fields.get("moe_layers", ()))
        spec = build_spec(name, ModelConfig(**fields))
    except (ValueError, TypeError) as e:
        raise RefitError(f"model_config_json is not a refit ModelConfig: {e}") from None
    if spec.digest() != digest:
        raise RefitError(f"model {name!r}: model_config_json gives digest {spec.digest()}, "
                         f"the worker reported {digest or '(none)'}")
    return spec


def config_difference(a: str, b: str) -> str | None:
    """The first field on which two registered model configs differ, as text; None if equal."""
    da, db = json.loads(a), json.loads(b)
    for key in sorted(set(da) | set(db)):
        if da.get(key) != db.get(key):
            return f"{key} {da.get(key)!r} vs {db.get(key)!r}"
    return None
