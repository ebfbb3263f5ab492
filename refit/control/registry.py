"""The coordinator's records — registered workers and cached plans — and the checks made on them.
Pure bookkeeping: no gRPC, no I/O; the coordinator (`refit.control.coordinator`) drives it."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from refit.control.common import ROLE_NAMES, config_difference, spec_from_registration, worker_id
from refit.control.v1 import refit_pb2 as pb
from refit.errors import RefitError
from refit.layouts import Layout, resolve_layout
from refit.plan import Plan
from refit.spec import ModelSpec

Send = Callable[[pb.CoordinatorMessage], Awaitable[None]]


@dataclass(eq=False)
class Worker:
    """One registration.  A re-registration of the same group/rank makes a new `Worker`."""

    info: pb.WorkerInfo
    session: str
    spec: ModelSpec
    layout: Layout
    send: Send
    task: asyncio.Task | None  # the Connect handler; cancelled when the worker is replaced
    version: int = 0
    stale: bool = False
    connected: bool = True
    busy: str = ""  # refit id this worker has not answered yet
    sent_plans: set[str] = field(default_factory=set)
    sent_prefixes: set[str] = field(default_factory=set)
    registered_unix: float = field(default_factory=time.time)
    replaced: bool = False  # a newer registration of the same group/rank took over
    worker_id: str = field(init=False)
    layout_str: str = field(init=False)  # resolved, as plans name layouts

    def __post_init__(self) -> None:
        self.worker_id = worker_id(self.info.group, self.info.rank)
        self.layout_str = self.layout.describe()

    @property
    def role(self) -> str:
        return ROLE_NAMES[self.info.role]

    def status(self) -> pb.WorkerStatus:
        return pb.WorkerStatus(worker_id=self.worker_id, info=self.info, session=self.session,
                               connected=self.connected, version=self.version, stale=self.stale,
                               busy_refit=self.busy, registered_unix=self.registered_unix)


@dataclass(eq=False)
class PlanEntry:
    plan_id: str
    plan: Plan
    summary: dict[str, Any]
    src_group: str
    dst_group: str
    plan_json: bytes
    members: tuple[str, ...]  # worker ids: source ranks, then destination ranks
    version: int = 0  # last committed
    generation: int = 0  # bumps when the data-plane communicator must be rebuilt
    sessions: tuple[str, ...] = ()
    broken: bool = False  # the last refit failed: rebuild before the next one

    @property
    def num_src(self) -> int:
        return len(self.plan.placement.src_gpus)

    def to_pb(self) -> pb.PlanSummary:
        s = self.summary
        return pb.PlanSummary(
            plan_id=self.plan_id, plan_hash=s["plan_id"], model=s["model"], model_digest=self.plan.model_digest,
            src_group=self.src_group, dst_group=self.dst_group, src_layout=s["src"], dst_layout=s["dst"],
            placement=s["placement"], planner=s["planner"], num_gpus=s["num_gpus"], total_bytes=s["total_bytes"],
            local_bytes=s["local_bytes"], remote_bytes=s["remote_bytes"], max_send_bytes=s["max_send_bytes"],
            max_recv_bytes=s["max_recv_bytes"], num_transfers=s["num_transfers"], num_buckets=s["num_buckets"],
            bucket_bytes=s["bucket_bytes"], plan_seconds=s.get("plan_seconds", 0.0), version=self.version)


def check_registration(info: pb.WorkerInfo, specs: dict[tuple[str, str], ModelSpec]) -> tuple[ModelSpec, Layout]:
    """Refuse a registration that cannot take part in a plan; return its spec and resolved layout."""
    if info.role not in ROLE_NAMES:
        raise RefitError("register: role must be ROLE_TRAINER or ROLE_ENGINE")
    if not info.group or "/" in info.group:
        raise RefitError(f"register: group must be a non-empty name without '/', got {info.group!r}")
    if not info.layout:
        raise RefitError("register: layout is empty")
    key = (info.model_name, info.model_config_json)  # the config decides the spec: build it once
    spec = specs.get(key)
    if spec is None:
        spec = spec_from_registration(info.model_name, info.model_config_json, info.model_digest)
        specs[key] = spec
    elif spec.digest() != info.model_digest:
        raise RefitError(f"model {info.model_name!r}: model_config_json gives digest {spec.digest()}, "
                         f"the worker reported {info.model_digest or '(none)'}")
    layout = resolve_layout(info.layout, spec, "src" if info.role == pb.ROLE_TRAINER else "dst")
    if info.rank >= layout.world_size:
        raise RefitError(f"register: rank {info.rank} is outside {layout.describe()} (world size {layout.world_size})")
    return spec, layout


def check_group_role(workers: dict[str, Worker], info: pb.WorkerInfo) -> None:
    for w in workers.values():
        if w.info.group == info.group and w.info.role != info.role and w.worker_id != worker_id(info.group, info.rank):
            raise RefitError(f"register: group {info.group!r} holds {w.role}s ({w.worker_id}); "
                             f"a {ROLE_NAMES[info.role]} cannot join it")


def group_members(workers: dict[str, Worker], group: str, role: int) -> list[Worker]:
    """Every rank of ``group``, checked: right role, one layout, one model, no rank missing."""
    members = sorted((w for w in workers.values() if w.info.group == group), key=lambda w: w.info.rank)
    want = ROLE_NAMES[role]
    if not members:
        raise RefitError(f"no worker is registered in group {group!r}")
    ref = members[0]
    if ref.info.role != role:
        raise RefitError(f"group {group!r} holds {ref.role}s; a plan's {'source' if want == 'trainer' else 'destination'} "
                         f"must be a {want} group")
    for w in members[1:]:
        if w.layout_str != ref.layout_str:
            raise RefitError(f"group {group!r}: {w.worker_id} registered layout {w.layout_str}, "
                             f"{ref.worker_id} {ref.layout_str}")
        if w.info.model_digest != ref.info.model_digest:
            raise RefitError(f"group {group!r}: {w.worker_id} holds model digest {w.info.model_digest}, "
                             f"{ref.worker_id} {ref.info.model_digest}")
        diff = config_difference(ref.info.model_config_json, w.info.model_config_json)
        if diff:
            raise RefitError(f"group {group!r}: {ref.worker_id} and {w.worker_id} hold different model configs: {diff}")
    ranks = {w.info.rank for w in members}
    for r in range(ref.layout.world_size):
        if r not in ranks:
            raise RefitError(f"group {group!r}: rank {r} of {ref.layout.describe()} is not registered "
                             f"(registered ranks: {sorted(ranks)})")
    return members


def check_same_model(src: Worker, dst: Worker) -> None:
    a, b = src.info, dst.info
    if a.model_digest != b.model_digest:
        raise RefitError(f"groups describe different models: {a.group!r} holds {a.model_name} (digest {a.model_digest}), "
                         f"{b.group!r} holds {b.model_name} (digest {b.model_digest})")
    diff = config_difference(a.model_config_json, b.model_config_json)
    if diff:
        raise RefitError(f"groups {a.group!r} and {b.group!r} hold models of equal tensors but different configs: {diff}")


def plan_json(plan: Plan) -> bytes:
    return json.dumps(plan.to_dict(), separators=(",", ":")).encode()
